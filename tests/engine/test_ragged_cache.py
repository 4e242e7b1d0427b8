"""The ragged KV cache: rows keep different numbers of a block's positions, and every operation the batch needs
(extract, filter, extend, compaction, the attention mask) sees only the positions a row kept."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from courier.engine.ragged_cache import COMPACT_MIN_COLUMNS, RaggedKVCache

HEADS, DIM = 2, 4


def tokens(*ids: float) -> tuple[mx.array, mx.array]:
    """Keys and values for one row: every element of position i holds `ids[i]`."""
    block = mx.broadcast_to(mx.array(ids, dtype=mx.float32)[None, None, :, None], (1, HEADS, len(ids), DIM))
    return block, -block


def batch(*rows: list[float]) -> RaggedKVCache:
    """A prompt-processed batch of rows (left-padded), adopted as a ragged cache."""
    caches = []
    for row in rows:
        cache = KVCache()
        cache.update_and_fetch(*tokens(*row))
        caches.append(cache)
    return RaggedKVCache.adopt(BatchKVCache.merge(caches))


def write(cache: RaggedKVCache, *rows: list[float]) -> None:
    keys = mx.concatenate([tokens(*row)[0] for row in rows])
    cache.update_and_fetch(keys, -keys)


def contents(cache: RaggedKVCache, row: int) -> list[float]:
    extracted = cache.extract(row)
    assert extracted.offset == extracted.keys.shape[2]
    assert mx.array_equal(extracted.values, -extracted.keys)
    return [float(v) for v in extracted.keys[0, 0, :, 0].tolist()]


def test_rows_keep_their_own_share_of_a_block() -> None:
    cache = batch([1, 2, 3], [10])
    write(cache, [4, 5, 6], [11, 12, 13])
    cache.keep([1, 3], width=3)
    assert contents(cache, 0) == [1, 2, 3, 4]
    assert contents(cache, 1) == [10, 11, 12, 13]
    assert cache.offset.tolist() == [4, 4]
    write(cache, [7], [14])
    assert contents(cache, 0) == [1, 2, 3, 4, 7]
    assert contents(cache, 1) == [10, 11, 12, 13, 14]


def test_columns_every_row_gave_back_are_freed() -> None:
    cache = batch([1, 2], [3, 4])
    write(cache, [5, 6, 7], [8, 9, 9])
    cache.keep([1, 2], width=3)
    assert cache.size() == 4  # the last column was a hole in both rows
    assert contents(cache, 1) == [3, 4, 8, 9]


def test_the_mask_hides_holes_and_padding_and_is_causal_in_the_block() -> None:
    cache = batch([1, 2], [3])
    write(cache, [4, 5], [6, 7])
    cache.keep([1, 2], width=2)
    mask = np.array(cache.make_mask(2))
    # Columns: pad/1, 2|3, block 4|6, block 5(hole)|7, then the new block's two positions.
    assert mask[0, 0].tolist() == [[True, True, True, False, True, False], [True, True, True, False, True, True]]
    assert mask[1, 0].tolist() == [[False, True, True, True, True, False], [False, True, True, True, True, True]]


def test_filter_and_extend_keep_each_rows_tokens() -> None:
    cache = batch([1, 2, 3], [10], [20, 21])
    write(cache, [4, 5], [11, 12], [22, 23])
    cache.keep([2, 1, 1], width=2)
    cache.filter([1, 2])
    assert contents(cache, 0) == [10, 11] and contents(cache, 1) == [20, 21, 22]
    other = BatchKVCache.merge([_single([30, 31, 32, 33, 34, 35])])
    cache.extend(other)
    assert [contents(cache, row) for row in range(3)] == [[10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    write(cache, [13], [24], [36])
    assert contents(cache, 2)[-2:] == [35, 36] and contents(cache, 0) == [10, 11, 13]


def test_holes_past_a_quarter_of_the_cache_are_compacted_away() -> None:
    cache = batch([0.5], [0.25])
    expected: list[list[float]] = [[0.5], [0.25]]
    for step in range(80):
        rows = [[float(1000 * row + 10 * step + i) for i in range(3)] for row in range(2)]
        kept = [1, 3] if step % 2 else [3, 1]  # each row keeps a different share each step: holes in both
        write(cache, *rows)
        cache.keep(kept, width=3)
        for row in range(2):
            expected[row] += rows[row][: kept[row]]
    longest = max(len(row) for row in expected)
    assert longest == 161 and cache.size() < longest + COMPACT_MIN_COLUMNS + 3  # 241 columns without compaction
    assert [contents(cache, row) for row in range(2)] == expected
    assert cache.offset.tolist() == [len(expected[0]), len(expected[1])]
    write(cache, [1.5], [2.5])
    assert contents(cache, 0)[-2:] == [expected[0][-1], 1.5]


def _single(row: list[float]) -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(*tokens(*row))
    return cache


def test_while_no_row_has_holes_the_mask_is_mlx_lms_own() -> None:
    cache = batch([1, 2], [3])
    write(cache, [4, 5], [6, 7])
    cache.keep([1, 1], width=2)  # both rows gave back as many: no holes
    mask = np.array(cache.make_mask(1))
    expected = BatchKVCache.make_mask(cache, 1)
    assert mask.tolist() == np.array(expected).tolist()
    assert mask[:, 0, 0].tolist() == [[True, True, True, True], [False, True, True, True]]
    cache.filter([1])  # the padded row alone: still no holes, padding gone
    assert np.array(cache.make_mask(1))[0, 0, 0].tolist() == [True, True, True]
