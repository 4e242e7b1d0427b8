"""The quantization plan of prompt-cache snapshots, pure: which layers, what shapes, what bytes, which group sizes a
model's head dimensions allow, and what a file's header says of it."""

from __future__ import annotations

from typing import Any

import pytest

from courier.core.prompt_cache.quantization import (
    DEFAULT_GROUP_SIZE,
    KvQuantization,
    QuantizationRefused,
    check_head_dims,
    compression,
    kv_bytes,
    quantization_from_settings,
    quantized_layers,
)

EIGHT, FOUR = KvQuantization(8), KvQuantization(4)


@pytest.mark.parametrize(
    ("quantization", "shape", "packed", "scales"),
    [
        (EIGHT, (1, 3, 100, 64), (1, 3, 100, 16), (1, 3, 100, 1)),  # SmolLM2: 3 KV heads of 64
        (FOUR, (1, 3, 100, 64), (1, 3, 100, 8), (1, 3, 100, 1)),
        (KvQuantization(8, 32), (1, 3, 100, 64), (1, 3, 100, 16), (1, 3, 100, 2)),
        (KvQuantization(4, 32), (1, 8, 7, 128), (1, 8, 7, 16), (1, 8, 7, 4)),
        (KvQuantization(8, 128), (2, 4, 1, 256), (2, 4, 1, 64), (2, 4, 1, 2)),
    ],
)
def test_stored_shapes_follow_the_head_dimension_and_group(
    quantization: KvQuantization, shape: tuple[int, ...], packed: tuple[int, ...], scales: tuple[int, ...]
) -> None:
    assert quantization.stored_shapes(shape) == (packed, scales)


@pytest.mark.parametrize(
    ("quantization", "head_dim", "itemsize", "row", "ratio"),
    [
        (EIGHT, 64, 4, 16 * 4 + 2 * 4, 256 / 72),  # float32 KV (the CPU): 3.56x
        (FOUR, 64, 4, 8 * 4 + 2 * 4, 256 / 40),  # 6.4x
        (EIGHT, 64, 2, 16 * 4 + 2 * 2, 128 / 68),  # float16 KV (Metal): 1.88x
        (FOUR, 64, 2, 8 * 4 + 2 * 2, 128 / 36),  # 3.56x
        (KvQuantization(8, 32), 64, 4, 16 * 4 + 4 * 4, 256 / 80),
        (KvQuantization(4, 128), 128, 2, 16 * 4 + 2 * 2, 256 / 68),
    ],
)
def test_bytes_per_stored_position(
    quantization: KvQuantization, head_dim: int, itemsize: int, row: int, ratio: float
) -> None:
    assert quantization.row_bytes(head_dim, itemsize) == row
    assert compression(head_dim, itemsize, quantization) == pytest.approx(ratio)
    # One layer's keys and values for 1 sequence x 3 heads x 10 positions.
    assert kv_bytes((1, 3, 10, head_dim), itemsize, quantization) == 2 * 30 * row
    assert kv_bytes((1, 3, 10, head_dim), itemsize, None) == 2 * 30 * head_dim * itemsize


@pytest.mark.parametrize(
    ("classes", "expected"),
    [
        (["KVCache"] * 3, (True, True, True)),
        (["ArraysCache", "KVCache", "ArraysCache", "KVCache"], (False, True, False, True)),  # hybrid: SSM exact
        (["RotatingKVCache", "KVCache"], (False, True)),  # a sliding window stays as computed
        (["ChunkedKVCache", "CacheList"], (False, False)),
        ([], ()),
    ],
)
def test_only_plain_attention_layers_are_quantized(classes: list[str], expected: tuple[bool, ...]) -> None:
    assert quantized_layers(classes) == expected


@pytest.mark.parametrize(
    ("head_dims", "group_size", "refused", "suggested"),
    [
        ((64,), 64, False, ""),
        ((64,), 32, False, ""),
        ((128, 64), 64, False, ""),
        ((64,), 128, True, "(32, 64)"),  # SmolLM2 at group 128
        ((16,), 32, True, "none does"),  # the tiny test models
        ((96,), 64, True, "(32)"),
        ((), 64, False, ""),  # no attention layer: nothing to quantize
    ],
)
def test_a_group_size_the_head_dimension_does_not_allow_is_refused(
    head_dims: tuple[int, ...], group_size: int, refused: bool, suggested: str
) -> None:
    quantization = KvQuantization(8, group_size)
    if not refused:
        check_head_dims(head_dims, quantization)
        return
    with pytest.raises(QuantizationRefused, match="does not divide") as error:
        check_head_dims(head_dims, quantization)
    assert suggested in str(error.value)


@pytest.mark.parametrize(("bits", "group_size"), [(3, 64), (16, 64), (8, 16), (4, 96)])
def test_only_supported_bits_and_group_sizes_exist(bits: int, group_size: int) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        KvQuantization(bits, group_size)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ({"bits": 8, "group_size": 64}, EIGHT),
        ({"bits": 4, "group_size": 32}, KvQuantization(4, 32)),
    ],
)
def test_a_header_states_the_quantization(value: Any, expected: KvQuantization | None) -> None:
    assert KvQuantization.from_header(value) == expected
    if expected is not None:
        assert expected.header() == value


@pytest.mark.parametrize(
    "value",
    [
        {"bits": 8},
        {"bits": 8, "group_size": 64, "more": 1},
        {"bits": 8.0, "group_size": 64},
        {"bits": True, "group_size": 64},
        {"bits": 5, "group_size": 64},
        [8, 64],
        "8",
    ],
)
def test_a_header_quantization_that_is_none_of_ours_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"quantization|must be one of"):
        KvQuantization.from_header(value)


def test_off_is_no_quantization_and_the_default_group_is_64() -> None:
    assert quantization_from_settings(None, 32) is None
    assert quantization_from_settings(4, 32) == KvQuantization(4, 32)
    assert KvQuantization(8).group_size == DEFAULT_GROUP_SIZE == 64
    assert EIGHT.label == "8-bit/64"
