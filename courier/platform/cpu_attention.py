"""Attention on MLX's CPU backend with an exponential ~8x cheaper than MLX's own.

MLX has no fused attention on the CPU: `mx.fast.scaled_dot_product_attention` falls back to its reference
composition (scores by matmul, the mask, a softmax, a matmul by the values). On an AVX2 x86 CPU the softmax's
`exp` costs ~21 ns per score, several times the scores' own matmul, and the scores grow with the square of the
prompt: at 4,096 tokens on SmolLM2 they are most of the prefill.

`install()` puts a function in place of `mx.fast.scaled_dot_product_attention` that computes the same composition
(same scale, mask and grouped heads as MLX's `fast.cpp` fallback) with the softmax in base 2: log2(e) is folded
into the query scale, and 2^x is 2^n, built from the exponent bits, times a degree-7 polynomial in the fraction
(relative error ≤ 2.5e-7). `mx.compile` fuses that into three kernels which g++ vectorizes (~2.5 ns per score). The
queries go in blocks of bounded scores, and under a causal mask a block skips the keys none of its queries sees.
It takes only float32 calls on the CPU with `MIN_QUERIES` queries or more and no attention sinks (prefill, long
verifies); decode steps, whose attention is not exp-bound, and everything else go to MLX's function unchanged. The
exponential carries its own vjp, so training through it (the tests' small models) still has gradients.

MLX compiles CPU kernels with the system C++ compiler (`g++`); without one `mx.compile` runs the ops one by one,
slower than MLX's `exp`, so nothing is installed and the report says why. A probe checks the composition against
MLX's on small causal, boolean-masked, additive-masked and unmasked inputs before anything is replaced.
"""

from __future__ import annotations

import fcntl
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

LOG2E = 1.4426950408889634
# 2^f for |f| ≤ 1/2: the Taylor series of exp(f ln 2) to degree 7 (error ≤ 6e-9), lowest degree first.
POW2_COEFFICIENTS = tuple(math.log(2) ** k / math.factorial(k) for k in range(8))
ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds a float32 of magnitude < 2^22 to an integer
LOWEST_EXPONENT = -127.0  # 2^-127's exponent bits are 0: exactly 0, as a denormal is flushed
# Fewer queries (decode steps, short verifies) take MLX's path: each decode step has a new key length, which
# would trace the compiled kernels afresh (see `Compiled`), and one query's softmax is a small part of its step.
MIN_QUERIES = 16
BLOCK_SCORES = 2 * 1024**2  # scores per block of queries (8 MiB of float32); never fewer rows than MIN_QUERIES
COMPILED_SHAPES = 64  # distinct input shapes one compiled function is traced for before it is started afresh
PROBE_TOLERANCE = 1e-5


@dataclass(frozen=True, slots=True)
class CpuAttention:
    """Whether the faster CPU attention is installed, for the startup log and `/health`."""

    active: bool
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {"active": self.active, "detail": self.detail}


def _shifted(scores: mx.array, row_max: mx.array) -> mx.array:
    return mx.maximum(scores - row_max, LOWEST_EXPONENT)


def _exponent_bits(t: mx.array) -> mx.array:
    """2^round(t) as float32 bits."""
    return mx.left_shift(((t + ROUND_MAGIC) - ROUND_MAGIC).astype(mx.int32) + 127, 23)


def _pow2_fraction_times(t: mx.array, scale: mx.array) -> mx.array:
    """2^(t - round(t)) times `scale`; the polynomial by Estrin's scheme, within MLX's 11-deep fusion."""
    c = POW2_COEFFICIENTS
    f = t - ((t + ROUND_MAGIC) - ROUND_MAGIC)
    f2 = f * f
    low = (c[0] + c[1] * f) + f2 * (c[2] + c[3] * f)
    high = (c[4] + c[5] * f) + f2 * (c[6] + c[7] * f)
    return (low + (f2 * f2) * high) * scale


class Compiled:
    """`mx.compile(function)`, traced afresh after `COMPILED_SHAPES` distinct input shapes.

    Shape-specialized kernels are what the C++ compiler vectorizes (a shapeless one walks strides and runs ~5x
    slower), and MLX keeps every traced shape in a list it scans on each call, for the life of the function. A
    prompt's chunks bring a new key length each, so the list is bounded here: past the limit the function is
    compiled again (MLX drops the old one's traces with it; the kernels it built stay loaded and on disk).
    """

    def __init__(self, function: Callable[..., mx.array]) -> None:
        self._function = function
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._compiled = self._fresh()

    def _fresh(self) -> Callable[..., mx.array]:
        function = self._function
        # A new function object each time: MLX keys its traces by the function's identity, and the old compiled
        # function erases its own traces when it is dropped.
        return mx.compile(lambda *arrays: function(*arrays))  # noqa: PLW0108

    @property
    def traced_shapes(self) -> int:
        return len(self._shapes)

    def __call__(self, *arrays: mx.array) -> mx.array:
        shapes = tuple(tuple(array.shape) for array in arrays)
        if shapes not in self._shapes:
            if len(self._shapes) >= COMPILED_SHAPES:
                self._shapes.clear()
                self._compiled = self._fresh()
            self._shapes.add(shapes)
        return self._compiled(*arrays)


_compiled_shifted = Compiled(_shifted)
_compiled_bits = Compiled(_exponent_bits)
_compiled_pow2 = Compiled(_pow2_fraction_times)


@mx.custom_function
def exp2_shifted(scores: mx.array, row_max: mx.array) -> mx.array:
    """2^(scores - row_max) for float32 differences ≤ 126, in three fused kernels; below -127 it is 0."""
    t = _compiled_shifted(scores, row_max)
    return _compiled_pow2(t, _compiled_bits(t).view(mx.float32))


@exp2_shifted.vjp
def _exp2_shifted_vjp(
    primals: tuple[mx.array, mx.array], cotangent: mx.array, output: mx.array
) -> tuple[mx.array, mx.array]:
    _scores, row_max = primals
    gradient = cotangent * output * math.log(2)
    broadcast = tuple(axis for axis, size in enumerate(row_max.shape) if size == 1 and gradient.shape[axis] != 1)
    return gradient, -mx.sum(gradient, axis=broadcast, keepdims=True)


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """MLX's reference attention (mlx/fast.cpp's fallback) with the softmax in base 2; float32 only.

    The queries go in blocks whose scores take at most `BLOCK_SCORES` floats: a block's score-sized arrays are
    small, and MLX, which allocates an output when it schedules the kernel, has only so many blocks in flight. Under
    a causal mask a block reads only the keys its last query sees. Nothing is evaluated here: a result no one reads
    (the last layer's attention in a prefill chunk, whose logits are not wanted) is never computed.
    """
    query_length, key_length = queries.shape[2], keys.shape[2]
    rows = max(MIN_QUERIES, BLOCK_SCORES // max(1, queries.shape[0] * queries.shape[1] * key_length))
    if rows >= query_length:
        return _attention_block(queries, keys, values, scale, mask)
    blocks = []
    for start in range(0, query_length, rows):
        stop = min(query_length, start + rows)
        block_mask = mask
        block_keys, block_values = keys, values
        if isinstance(mask, str):  # causal: query i sees keys up to i + (keys - queries)
            first, last = start + key_length - query_length, stop + key_length - query_length
            if first >= 0:  # every query sees a key: those past the last query's are masked for all, and skipped
                block_keys, block_values = keys[:, :, :last], values[:, :, :last]
            else:  # a query that sees no key averages all the values, as in MLX's: all the keys, the mask explicit
                block_mask = _causal_mask(first, stop - start, key_length)
        elif mask is not None and mask.ndim >= 2 and mask.shape[-2] == query_length:
            block_mask = mask[..., start:stop, :]
        blocks.append(_attention_block(queries[:, :, start:stop], block_keys, block_values, scale, block_mask))
    return mx.concatenate(blocks, axis=2)


def _attention_block(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """The scores are scaled by log2(e) with the queries, so softmax's exp(s - max) is 2^(s' - max'); the weighted
    values are divided by the weights' sum after the product (one pass less over the scores, and one array less)."""
    batch, query_heads, query_length, _ = queries.shape
    kv_heads = keys.shape[1]
    repeats = query_heads // kv_heads
    q = queries * mx.array(scale * LOG2E, dtype=queries.dtype)
    k, v = keys, values
    if repeats > 1:
        q = q.reshape(batch, kv_heads, repeats, query_length, q.shape[-1])
        k = mx.expand_dims(k, 2)
        v = mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):  # "causal": query i sees keys up to i + (keys - queries)
        mask = _causal_mask(k.shape[-2] - query_length, query_length, k.shape[-2])
    if mask is not None:
        if repeats > 1 and mask.ndim >= 3:
            if mask.shape[-3] == 1:
                mask = mx.expand_dims(mask, -3)
            else:
                mask = mask.reshape(*mask.shape[:-3], kv_heads, repeats, *mask.shape[-2:])
        lowest = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, lowest)
        else:  # in base 2 too, kept finite: finfo.min times log2(e) would be -inf, and a row of them NaN
            scores = scores + mx.maximum(mask.astype(scores.dtype) * LOG2E, lowest)
    weights = cast("mx.array", exp2_shifted(scores, mx.stop_gradient(mx.max(scores, axis=-1, keepdims=True))))
    out = (weights @ v) / mx.sum(weights, axis=-1, keepdims=True)
    if repeats > 1:
        out = out.reshape(batch, query_heads, query_length, out.shape[-1])
    return out


def _causal_mask(first_key: int, query_length: int, key_length: int) -> mx.array:
    """Query i (from 0) sees the keys up to `first_key` + i."""
    return mx.arange(first_key, first_key + query_length)[:, None] >= mx.arange(key_length)[None, :]


_installed: CpuAttention | None = None
_wished: bool | None = None  # the `enabled` that `_installed` answers
_mlx_attention: Callable[..., mx.array] | None = None  # MLX's own function, while ours stands in its place


def install(enabled: bool = True) -> CpuAttention:
    """Put the faster attention in place of `mx.fast.scaled_dot_product_attention` for float32 CPU calls, or, with
    `enabled` False, put MLX's own back. A second call with the same wish returns the first call's report."""
    global _installed, _wished, _mlx_attention
    if _installed is not None and _wished == enabled:
        return _installed
    if _mlx_attention is not None:
        mx.fast.scaled_dot_product_attention = _mlx_attention
        _mlx_attention = None
    _installed, _wished = _install(enabled), enabled
    if _installed.active:
        _mlx_attention = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _dispatching(_mlx_attention)
    return _installed


def _install(enabled: bool) -> CpuAttention:
    unusable = _why_unusable(enabled)
    if unusable is not None:
        return CpuAttention(False, f"{unusable}; MLX's own softmax")
    mlx_attention = mx.fast.scaled_dot_product_attention
    try:
        with _kernel_build_lock():
            error = _probe(mlx_attention)
    except (RuntimeError, ValueError, OSError) as failure:  # RuntimeError: a kernel build; OSError: the lock's file
        return CpuAttention(False, f"the probe could not run ({failure}); MLX's own softmax")
    if error > PROBE_TOLERANCE:
        return CpuAttention(False, f"the probe differed from MLX's by {error:.1e}; MLX's own softmax")
    return CpuAttention(True, "float32 CPU attention with a compiled polynomial exp (cpu_attention.py)")


def _why_unusable(enabled: bool) -> str | None:
    if not enabled:
        return "off by configuration"
    if mx.default_device().type != mx.DeviceType.cpu:
        return "the model runs on the GPU, where MLX's attention is a fused kernel"
    if os.environ.get("MLX_DISABLE_COMPILE"):
        return "MLX_DISABLE_COMPILE is set"
    if shutil.which("g++") is None:
        return "no g++ for MLX to compile CPU kernels with"
    return None


def _dispatching(mlx_attention: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        *,
        scale: float,
        mask: mx.array | str | None = None,
        sinks: mx.array | None = None,
        stream: Any = None,
        **options: Any,  # what a later MLX adds (0.32.4: force_fused) goes to MLX's own
    ) -> mx.array:
        if (
            sinks is None
            and stream is None
            and not options
            and queries.shape[2] >= MIN_QUERIES
            and queries.dtype == mx.float32
            and keys.dtype == mx.float32
            and values.dtype == mx.float32
            and mx.default_device().type == mx.DeviceType.cpu
        ):
            return attention(queries, keys, values, scale=scale, mask=mask)
        return mlx_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, stream=stream, **options)

    scaled_dot_product_attention.__doc__ = mlx_attention.__doc__
    return scaled_dot_product_attention


@contextmanager
def _kernel_build_lock() -> Iterator[None]:
    """Hold a lock beside MLX's kernel cache while the probe builds the kernels.

    MLX compiles a kernel into `$TMPDIR/mlx/VERSION/cpu` when the library is not there yet, and a second process
    that looks meanwhile loads a half-written library and fails. Servers started together on a fresh machine would
    all build the same three kernels: the first to take the lock builds them, the others then load them.
    """
    directory = Path(tempfile.gettempdir()) / "mlx" / str(getattr(mx, "__version__", "unknown")) / "cpu"
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "courier-cpu-attention.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _probe(mlx_attention: Callable[..., mx.array]) -> float:
    """The largest difference from MLX's attention over a causal, a boolean-masked, an additive-masked and an
    unmasked input."""
    with mx.stream(mx.cpu):
        key = mx.random.key(0)
        q, k, v = (mx.random.normal((1, 4, 6, 8), key=part) for part in mx.random.split(key, 3))
        allowed = mx.random.uniform(shape=(1, 1, 6, 6), key=key) > 0.3
        bias = mx.random.normal((1, 4, 6, 6), key=key)
        worst = 0.0
        for mask in ("causal", allowed, bias, None):
            ours = attention(q, k[:, :2], v[:, :2], scale=0.35, mask=mask)
            theirs = mlx_attention(q, k[:, :2], v[:, :2], scale=0.35, mask=mask)
            worst = max(worst, cast("float", mx.abs(ours - theirs).max().item()))
    return worst
