"""A batched KV cache whose rows can take back different numbers of tokens: the cache speculative steps verify in.

mlx-lm's `BatchKVCache` keeps every row right-aligned behind one shared write position, so it can only trim the
same number of tokens from every row. A verify step writes a block of several positions per row and each row keeps
its own number of them (its accepted draft). `RaggedKVCache` keeps the block where it was written and marks the
rejected positions as holes: a per-row validity map, which the attention mask honours, and a per-row offset that
counts only valid positions (rotary positions stay exact, so the next token sees exactly the keys it would have seen
had the rejected tokens never been written). Columns that are holes in every row are given back at once; when holes
take more than a quarter of the cache, the rows are compacted (one gather of the valid positions, right-aligned).

Validity is kept on the host (numpy, a byte per position and row, grown in chunks) and changes only between forward
passes. The mask is built lazily on the device: from mlx-lm's own causal mask while no row has holes (a batch that
has verified nothing, or whose rows all kept as many tokens), else from a device copy of the validity map made when
holes last changed (every column written since is valid). Building it on the host each step would cost a plain
step time while the previous step computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache

# Compact once holes take more than this share of the cache's columns, and at least this many columns.
COMPACT_SHARE = 0.25
COMPACT_MIN_COLUMNS = 64
# The host validity map grows by this many columns at a time.
VALID_CHUNK = 256

BoolMatrix = np.ndarray[Any, np.dtype[np.bool_]]


class RaggedKVCache(BatchKVCache):  # type: ignore[misc]
    """A `BatchKVCache` with holes: `valid[row, column]` says whether a column holds one of the row's tokens."""

    keys: Any
    values: Any
    offset: Any
    left_padding: Any
    _idx: int

    def __init__(self, left_padding: Sequence[int]) -> None:
        super().__init__(list(left_padding))
        self.valid: BoolMatrix = np.zeros((len(left_padding), 0), dtype=np.bool_)
        self._holes: mx.array | None = None  # the validity map on the device while some row has holes

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> RaggedKVCache:
        """The same rows, same arrays (no copy): a finalized `BatchKVCache` from prompt processing."""
        ragged = cls.__new__(cls)
        ragged.keys, ragged.values = cache.keys, cache.values
        ragged.offset, ragged.left_padding, ragged._idx = cache.offset, cache.left_padding, cache._idx
        ragged._right_padding = None
        padding = np.array(cache.left_padding.tolist(), dtype=np.int64)
        ragged.valid = np.arange(cache._idx)[None, :] >= padding[:, None]
        ragged._holes = None
        return ragged

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 (mlx-lm's name)
        """Causal over the new block, and only the valid columns of what is already cached."""
        if self._holes is None:  # every row's tokens are contiguous behind its left padding
            return cast("mx.array", super().make_mask(N, return_array=return_array, **kwargs))
        rows, known = self._holes.shape
        written = mx.concatenate([self._holes, mx.ones((rows, self._idx + N - known), dtype=mx.bool_)], axis=1)
        columns = mx.arange(self._idx + N)
        causal = columns[None, :] <= (self._idx + mx.arange(N))[:, None]
        return written[:, None, None, :] & causal[None, None, :, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._mark_written(keys.shape[2])
        return super().update_and_fetch(keys, values)  # type: ignore[no-any-return]

    def _mark_written(self, width: int) -> None:
        """The next `width` columns hold every row's tokens."""
        if self.valid.shape[1] < self._idx + width:
            grown = np.zeros((self.valid.shape[0], self._idx + width + VALID_CHUNK), dtype=np.bool_)
            grown[:, : self._idx] = self.valid[:, : self._idx]
            self.valid = grown
        self.valid[:, self._idx : self._idx + width] = True

    def keep(self, kept: Sequence[int], width: int) -> None:
        """After a block of `width` positions per row: row i keeps the first `kept[i]` of them, the rest are holes."""
        start = self._idx - width
        dropped = np.array([width - k for k in kept], dtype=np.int64)
        for row, count in enumerate(kept):
            self.valid[row, start + count : self._idx] = False
        self.offset = self.offset - mx.array(dropped.astype(np.int32))
        tail = int(dropped.min()) if dropped.size else 0
        if tail:  # holes in every row at the end: give the columns back
            self._idx -= tail
        counts = self.valid[:, : self._idx].sum(axis=1)
        waste = self._idx - int(counts.max()) if counts.size else 0
        if waste > max(COMPACT_MIN_COLUMNS, COMPACT_SHARE * self._idx):
            self._compact(counts)
        elif dropped.size and int(dropped.max()) > tail:  # some row kept fewer than another: new holes
            self._mark_holes()

    def _mark_holes(self) -> None:
        """Copy the validity map to the device if some row has holes (columns invalid after its first valid one)."""
        valid = self.valid[:, : self._idx]
        first = np.where(valid.any(axis=1), valid.argmax(axis=1), self._idx)
        contiguous = bool((valid.sum(axis=1) == self._idx - first).all())
        self._holes = None if contiguous else mx.array(valid)

    def _compact(self, counts: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Every row's valid columns, right-aligned in a cache as long as the longest row."""
        length = int(counts.max())
        gather = np.zeros((len(counts), length), dtype=np.int32)
        for row, count in enumerate(counts.tolist()):
            gather[row, length - count :] = np.flatnonzero(self.valid[row, : self._idx])
        index = mx.array(gather)[:, None, :, None]
        used = self._idx
        self._map_arrays(lambda array: mx.take_along_axis(array[..., :used, :], index, axis=2))
        self._idx = length
        self.valid = np.arange(length)[None, :] >= (length - counts)[:, None]
        self.left_padding = mx.array((length - counts).astype(np.int32))
        self._holes = None

    def filter(self, batch_indices: Sequence[int]) -> None:
        rows = list(batch_indices)
        self._map_arrays(lambda array: array[mx.array(rows)])
        self.offset = self.offset[mx.array(rows)]
        self.left_padding = self.left_padding[mx.array(rows)]
        self.valid = self.valid[rows, : self._idx]
        used = np.flatnonzero(self.valid.any(axis=0))
        lead = int(used[0]) if used.size else self._idx
        if lead > 0:  # columns no remaining row uses, on the left
            self._map_arrays(lambda array: array[..., lead:, :])
            self._idx -= lead
            self.valid = self.valid[:, lead:]
            self.left_padding = mx.maximum(self.left_padding - lead, 0)
        self._mark_holes()

    def extend(self, other: BatchKVCache) -> None:
        other_valid = other.valid if isinstance(other, RaggedKVCache) else RaggedKVCache.adopt(other).valid
        width = max(self._idx, other._idx)
        mine = _left_pad(self.valid[:, : self._idx], width)
        theirs = _left_pad(other_valid[:, : other._idx], width)
        self._extend_arrays(other)
        self.valid = np.concatenate([mine, theirs], axis=0)
        self._mark_holes()

    def extract(self, idx: int) -> KVCache:
        """Row `idx`'s valid positions as a plain single-sequence cache."""
        cache = KVCache()
        columns = np.flatnonzero(self.valid[idx, : self._idx])
        first = int(columns[0]) if columns.size else self._idx
        if columns.size == self._idx - first:  # no holes: a slice
            take: Any = slice(first, self._idx)
        else:
            take = mx.array(columns.astype(np.int32))
        keys, values = self._row_arrays(idx, take)
        cache.keys, cache.values = mx.contiguous(keys), mx.contiguous(values)
        cache.offset = cache.keys.shape[2]
        return cache

    def _map_arrays(self, change: Callable[[mx.array], mx.array]) -> None:
        """Apply `change` to every array holding keys and values (a quantized cache holds three for each)."""
        if self.keys is not None:
            self.keys, self.values = tree_map(change, (self.keys, self.values))

    def _extend_arrays(self, other: BatchKVCache) -> None:
        """`other`'s rows below these, both right-aligned at the longer one's write position."""
        super().extend(other)

    def _row_arrays(self, idx: int, take: Any) -> tuple[mx.array, mx.array]:
        """Row `idx`'s keys and values at the columns `take` selects, as the model computes with them."""
        return self.keys[idx : idx + 1, :, take], self.values[idx : idx + 1, :, take]

    def trim(self, n: int) -> int:
        raise NotImplementedError("a ragged cache takes tokens back per row, with keep()")


def _left_pad(valid: BoolMatrix, width: int) -> BoolMatrix:
    rows, columns = valid.shape
    return np.concatenate([np.zeros((rows, width - columns), dtype=np.bool_), valid], axis=1)
