"""Which MLX device serves the model, and the serving weight format that suits it."""

from __future__ import annotations

import mlx.core as mx

CPU = "cpu"
METAL = "metal"
CUDA = "cuda"


def active_device() -> str:
    if mx.default_device().type == mx.DeviceType.cpu:
        return CPU
    if mx.metal.is_available():
        return METAL
    return CUDA


def serving_dtype(weight_format: str, device: str) -> mx.Dtype | None:
    """The dtype weights are served in, or None to keep them as stored (quantized included).

    On CPU the quantized kernels are the bottleneck and BLAS only speeds up float32,
    so `auto` dequantizes to float32 there; on Metal and CUDA quantized weights are
    faster and smaller, so `auto` keeps them.
    """
    if weight_format == "auto":
        return mx.float32 if device == CPU else None
    if weight_format == "native":
        return None
    return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[weight_format]
