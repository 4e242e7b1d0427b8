"""Turns a quantized model into plain floating-point weights of one dtype.

Dequantizing straight into the target dtype (scales and biases cast first) is
about 4x faster on CPU than mlx-lm's `dequantize_model`, which computes in the
stored float16 and then needs a second cast. Layers this module does not know
(mixture-of-experts switch layers) go through mlx-lm's function.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import dequantize_model


def to_dense_dtype(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    replacements: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = _dequantized(module, dtype)
            has_bias = "bias" in module
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
            linear.weight = weight
            if has_bias:
                linear.bias = module.bias.astype(dtype)
            replacements.append((name, linear))
        elif isinstance(module, nn.QuantizedEmbedding):
            weight = _dequantized(module, dtype)
            embedding = nn.Embedding(weight.shape[0], weight.shape[1])
            embedding.weight = weight
            replacements.append((name, embedding))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    model = dequantize_model(model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _dequantized(module: nn.QuantizedLinear | nn.QuantizedEmbedding, dtype: mx.Dtype) -> mx.array:
    biases = module.biases.astype(dtype) if module.biases is not None else None
    return mx.dequantize(
        module.weight,
        module.scales.astype(dtype),
        biases,
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )


def describe_weights(model: nn.Module, config: dict[str, Any]) -> str:
    """How the checkpoint stores its weights: "4-bit affine, group size 32", "bfloat16", ..."""
    quantization = config.get("quantization")
    if isinstance(quantization, dict) and "bits" in quantization:
        mode = quantization.get("mode", "affine")
        return f"{quantization['bits']}-bit {mode}, group size {quantization.get('group_size', '?')}"
    for _, parameter in tree_flatten(model.parameters()):
        if isinstance(parameter, mx.array) and mx.issubdtype(parameter.dtype, mx.floating):
            return dtype_name(parameter.dtype)
    return "unknown"


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")
