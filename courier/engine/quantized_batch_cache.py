"""The running batch's attention KV kept quantized (`--kv-bits`): a ragged batch cache of packed values.

`BatchQuantizedKVCache` is a `RaggedKVCache` (rows left-padded behind one write position, a per-row validity map,
per-row take-back for speculation) whose keys and values are each three arrays, as MLX's affine quantization gives
them: uint32 words packing `bits`-bit values, and one scale and one bias per group of `group_size` values along the
head dimension. Because the cache has `bits` and `group_size`, mlx-lm's attention
(`models/base.scaled_dot_product_attention`) computes with it through `quantized_matmul`, without touching the model.

Groups never cross positions, so every operation on positions (taking columns back, compacting, dropping rows,
aligning two batches) is the same gather or slice on each of the three arrays, and exact. Rows join quantized:
prompts are prefilled at full precision (mlx-lm's `BatchKVCache`, at most the prefill batch's rows) and a row's KV is
quantized once, when it joins the generation batch (`as_generation_layer`). A row leaves (`extract`) as a plain
`KVCache`, dequantized, which every consumer of an extracted row (snapshots, `n` forks, shared prefixes) takes as it
is. A snapshot stored with `--prompt-cache-bits` quantizes those values again: MLX's quantization is not idempotent
(about one packed word in five changes, each value by at most one quantization step), so a row restored from such a
snapshot carries that second rounding; handing the store the packed row itself is not done yet.

Only plain attention layers (`BatchKVCache`) are quantized; recurrent state, sliding-window and chunked layers stay
exact.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.ragged_cache import RaggedKVCache

# Packed storage grows by this many positions at a time (mlx-lm's caches grow by the same step).
GROW_STEP = 256

Quantized = tuple[mx.array, mx.array, mx.array]  # packed values, scales, biases


class BatchQuantizedKVCache(RaggedKVCache):
    """A ragged batch cache whose keys and values are `(packed, scales, biases)` triples."""

    bits: int
    group_size: int

    @classmethod
    def quantize(cls, cache: BatchKVCache, quantization: KvQuantization) -> BatchQuantizedKVCache:
        """`cache`'s rows (a finalized prompt batch's, or a ragged batch's), quantized: the same positions, holes
        and padding."""
        ragged = cache if isinstance(cache, RaggedKVCache) else RaggedKVCache.adopt(cache)
        quantized = cls.__new__(cls)
        quantized.bits, quantized.group_size = quantization.bits, quantization.group_size
        quantized.offset, quantized.left_padding, quantized._idx = ragged.offset, ragged.left_padding, ragged._idx
        quantized._right_padding = None
        quantized.valid, quantized._holes = ragged.valid, ragged._holes
        quantized.keys = quantized.values = None
        if ragged.keys is not None:
            used = ragged._idx
            quantized.keys = quantized._pack(ragged.keys[..., :used, :])
            quantized.values = quantized._pack(ragged.values[..., :used, :])
        return quantized

    @property
    def quantization(self) -> KvQuantization:
        return KvQuantization(bits=self.bits, group_size=self.group_size)

    def _pack(self, array: mx.array) -> Quantized:
        packed, scales, biases = mx.quantize(array, group_size=self.group_size, bits=self.bits)
        return packed, scales, biases

    def _unpack(self, parts: Quantized) -> mx.array:
        return mx.dequantize(*parts, group_size=self.group_size, bits=self.bits)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:  # type: ignore[override]
        width = keys.shape[2]
        self._mark_written(width)
        start = self._idx
        if self.keys is None or start + width > self.keys[0].shape[2]:
            self._grow(keys, values, start + width)
        for stored, new in ((self.keys, self._pack(keys)), (self.values, self._pack(values))):
            for part, written in zip(stored, new, strict=True):
                part[..., start : start + width, :] = written
        self.offset = self.offset + width
        self._idx += width
        return self._fetch()

    def _fetch(self) -> tuple[Quantized, Quantized]:
        used = self._idx
        keys, values = tree_map(lambda array: array[..., :used, :], (self.keys, self.values))
        return keys, values

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        """Room for at least `needed` positions: the stored ones, then zeros up to a multiple of `GROW_STEP`."""
        capacity = (needed + GROW_STEP - 1) // GROW_STEP * GROW_STEP
        if self.keys is None:
            self.keys, self.values = self._empty(keys), self._empty(values)
        used = self._idx

        def grown(array: mx.array) -> mx.array:
            kept = array[..., :used, :]
            room = mx.zeros((*kept.shape[:2], capacity - used, kept.shape[3]), dtype=kept.dtype)
            return mx.concatenate([kept, room], axis=2)

        self.keys, self.values = tree_map(grown, (self.keys, self.values))

    def _empty(self, like: mx.array) -> Quantized:
        """No positions yet, shaped for KV like `like` (rows, heads, positions, head dimension)."""
        rows, heads, _, dim = like.shape
        packed, groups = self.quantization.stored_shapes((rows, heads, 0, dim))
        return mx.zeros(packed, dtype=mx.uint32), mx.zeros(groups, dtype=like.dtype), mx.zeros(groups, dtype=like.dtype)

    def _extend_arrays(self, other: BatchKVCache) -> None:
        """`other`'s rows (quantized here if they are not yet) below these, right-aligned at the later position."""
        theirs = other if isinstance(other, BatchQuantizedKVCache) else self.quantize(other, self.quantization)
        if theirs.bits != self.bits or theirs.group_size != self.group_size:
            raise ValueError(f"cannot join a {theirs.quantization.label} batch to a {self.quantization.label} one")
        width = max(self._idx, theirs._idx)
        mine_shift, their_shift = width - self._idx, width - theirs._idx
        if self.keys is not None or theirs.keys is not None:
            self.keys, self.values = _stacked(self, theirs, width)
        self.offset = mx.concatenate([self.offset, theirs.offset])
        self.left_padding = mx.concatenate([self.left_padding + mine_shift, theirs.left_padding + their_shift])
        self._idx = width

    def _row_arrays(self, idx: int, take: Any) -> tuple[mx.array, mx.array]:
        keys, values = tree_map(lambda array: array[idx : idx + 1, :, take], (self.keys, self.values))
        return self._unpack(keys), self._unpack(values)

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        total: int = tree_reduce(lambda sum_, array: sum_ + array.nbytes, (self.keys, self.values), 0)
        return total


def _stacked(top: BatchQuantizedKVCache, bottom: BatchQuantizedKVCache, width: int) -> tuple[Any, Any]:
    """Both caches' keys and values, each row's columns right-aligned at `width`, top's rows first."""
    reference = top if top.keys is not None else bottom

    def aligned(cache: BatchQuantizedKVCache, arrays: Quantized | None, like: Quantized) -> list[mx.array]:
        rows = cache.offset.shape[0]
        if arrays is None:
            return [mx.zeros((rows, part.shape[1], width, part.shape[3]), dtype=part.dtype) for part in like]
        used, shift = cache._idx, width - cache._idx
        return [mx.pad(part[..., :used, :], [(0, 0), (0, 0), (shift, 0), (0, 0)]) for part in arrays]

    def joined(top_arrays: Quantized | None, bottom_arrays: Quantized | None, like: Quantized) -> Quantized:
        upper, lower = aligned(top, top_arrays, like), aligned(bottom, bottom_arrays, like)
        packed, scales, biases = (mx.concatenate(list(pair), axis=0) for pair in zip(upper, lower, strict=True))
        return packed, scales, biases

    return joined(top.keys, bottom.keys, reference.keys), joined(top.values, bottom.values, reference.values)


def as_generation_layer(layer: Any, quantization: KvQuantization | None) -> Any:
    """A generation batch's layer as it runs: a plain attention layer (`BatchKVCache`) ragged, or quantized with
    `quantization`; any other layer (already converted, recurrent, sliding-window) as it is."""
    if type(layer) is not BatchKVCache and type(layer) is not RaggedKVCache:
        return layer
    if quantization is None:
        return layer if isinstance(layer, RaggedKVCache) else RaggedKVCache.adopt(layer)
    return BatchQuantizedKVCache.quantize(layer, quantization)
