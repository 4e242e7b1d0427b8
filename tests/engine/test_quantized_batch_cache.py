"""`BatchQuantizedKVCache` directly: rows of different lengths keep, through every batch operation (new positions,
per-row take-back, compaction, dropping rows, joining another batch), exactly the quantized values of their own
positions; a row leaves dequantized, and packing it again with the same bits and group (a quantized snapshot) moves
each value by at most one quantization step."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.quantized_batch_cache import BatchQuantizedKVCache, as_generation_layer
from courier.engine.ragged_cache import RaggedKVCache

HEADS, DIM = 2, 128


def positions(count: int, seed: int) -> mx.array:
    return mx.random.normal((1, HEADS, count, DIM), key=mx.random.key(seed))


def batch_of(rows: list[mx.array]) -> BatchKVCache:
    caches = []
    for row in rows:
        cache = KVCache()
        cache.update_and_fetch(row, -row)
        caches.append(cache)
    return BatchKVCache.merge(caches)


def rounded(row: mx.array, quantization: KvQuantization) -> mx.array:
    """What quantization keeps of `row`."""
    packed = mx.quantize(row, group_size=quantization.group_size, bits=quantization.bits)
    return mx.dequantize(*packed, group_size=quantization.group_size, bits=quantization.bits)


def assert_rows(cache: BatchQuantizedKVCache, rows: list[mx.array]) -> None:
    for index, row in enumerate(rows):
        extracted = cache.extract(index)
        expected = rounded(row, cache.quantization)
        assert extracted.offset == row.shape[2]
        assert mx.array_equal(extracted.keys, expected).item()
        assert mx.array_equal(extracted.values, rounded(-row, cache.quantization)).item()


QUANTIZATIONS = [KvQuantization(8), KvQuantization(4, group_size=32), KvQuantization(8, group_size=128)]


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=lambda q: q.label)
def test_rows_keep_their_values_through_every_operation(quantization: KvQuantization) -> None:
    rows = [positions(5, 1), positions(9, 2), positions(3, 3)]
    cache = as_generation_layer(batch_of(rows), quantization)
    assert isinstance(cache, BatchQuantizedKVCache) and (cache.bits, cache.group_size) == (
        4 if "4" in quantization.label[:1] else 8,
        quantization.group_size,
    )
    assert_rows(cache, rows)
    block = positions(4, 4).reshape(1, HEADS, 4, DIM)
    blocks = mx.concatenate([block, block + 1, block - 1])
    cache.update_and_fetch(blocks, -blocks)
    cache.keep([4, 1, 2], 4)  # a verify step: each row keeps its own share of the block
    rows = [
        mx.concatenate([row, blocks[index : index + 1, :, :kept]], axis=2)
        for index, (row, kept) in enumerate(zip(rows, [4, 1, 2], strict=True))
    ]
    assert_rows(cache, rows)
    cache.filter([0, 2])
    rows = [rows[0], rows[2]]
    assert_rows(cache, rows)
    joining = [positions(12, 5)]
    cache.extend(batch_of(joining))  # a plain prompt batch joins: quantized as it does
    rows += joining
    assert_rows(cache, rows)
    step = positions(3, 6)[:, :, :1].reshape(1, HEADS, 1, DIM)
    steps = mx.concatenate([step, step * 2, step * 3])
    keys, values = cache.update_and_fetch(steps, -steps)
    assert len(keys) == len(values) == 3 and keys[0].dtype == mx.uint32  # what quantized attention takes
    rows = [mx.concatenate([row, steps[index : index + 1]], axis=2) for index, row in enumerate(rows)]
    assert_rows(cache, rows)


def test_holes_past_the_threshold_compact_the_rows() -> None:
    quantization = KvQuantization(8)
    rows = [positions(70, 7), positions(70, 8)]
    cache = as_generation_layer(batch_of(rows), quantization)
    first, second = positions(80, 9), positions(80, 10)
    for block, kept in ((first, [80, 1]), (second, [1, 80])):  # each row gives back 79 columns of one block
        blocks = mx.concatenate([block, block + 1])
        cache.update_and_fetch(blocks, -blocks)
        cache.keep(kept, 80)
    assert cache._idx == 151 and cache._holes is None  # compacted: holes took more than a quarter of the columns
    rows = [
        mx.concatenate([rows[0], first, second[:, :, :1]], axis=2),
        mx.concatenate([rows[1], first[:, :, :1] + 1, second + 1], axis=2),
    ]
    assert_rows(cache, rows)


@pytest.mark.parametrize("quantization", QUANTIZATIONS, ids=lambda q: q.label)
def test_a_row_packed_again_moves_by_at_most_one_step(quantization: KvQuantization) -> None:
    cache = as_generation_layer(batch_of([positions(33, 10)]), quantization)
    extracted = cache.extract(0)
    again = rounded(extracted.keys, quantization)
    scales = mx.abs(mx.repeat(cache.keys[1][..., : cache._idx, :], quantization.group_size, axis=-1))
    assert (mx.abs(again - extracted.keys) <= scales * 1.001).all().item()


def test_other_layers_are_left_as_they_are() -> None:
    plain = batch_of([positions(3, 11)])
    assert type(as_generation_layer(plain, None)) is RaggedKVCache
    quantized = as_generation_layer(plain, KvQuantization(8))
    assert as_generation_layer(quantized, KvQuantization(8)) is quantized
