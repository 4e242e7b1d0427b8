"""Turns a quantized model into plain floating-point weights of one dtype.

Dequantizing straight into the target dtype (scales and biases cast first) is
about 4x faster on CPU than mlx-lm's `dequantize_model`, which computes in the
stored float16 and then needs a second cast. Layers this module does not know
(mixture-of-experts switch layers) go through mlx-lm's function.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten
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
