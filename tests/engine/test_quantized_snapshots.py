"""Quantized prompt-cache snapshots on real model states (a dense and a hybrid tiny model with 64-dimension heads):
stored quantized in both tiers and dequantized once on restore, recurrent state exact, files that say so and files
that do not, a layout check for the packed arrays, and what it does to the next tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from courier.core.prompt_cache.entries import Bucket, Origin, disk_footprint
from courier.core.prompt_cache.quantization import KvQuantization, kv_bytes
from courier.core.prompt_cache.rejections import FileRejection
from courier.engine.model_state import CachedPrefix, attention_head_dims, compact_copy, prefill, resume
from courier.engine.prompt_cache.codec import decode_state, encode_state
from courier.engine.prompt_cache.files import (
    FileTrust,
    UnreadableSnapshot,
    read_index_entry,
    read_snapshot,
    write_snapshot,
)
from courier.engine.prompt_cache.layout import DeclaredArray, LayoutMismatch, StateLayout, measure_layout
from tests.support import tiny_models
from tests.support.kv_drift import measure
from tests.support.snapshot_forgery import put_together, take_apart

TOKENS = tuple(range(5, 45))
EIGHT, FOUR = KvQuantization(8), KvQuantization(4)
IDENTITY = "q" * 64
KEY = b"k" * 32
BUCKET = Bucket(model_id="wide", template_signature="t")
ROOM = 1 << 30


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def wide(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny model with 64-dimension attention heads, and its tokenizer."""
    build = tiny_models.build_wide_llama if request.param == "dense" else tiny_models.build_wide_qwen3_next
    return load(str(build(smollm2_dir, tmp_path_factory.mktemp(f"wide-{request.param}"))))[:2]


@pytest.fixture(scope="module")
def computed(wide: Any) -> list[Any]:
    """The model's cache after TOKENS, as computed."""
    return prefill(wide[0], TOKENS)


def attention(layers: list[Any]) -> list[Any]:
    return [layer for layer in layers if isinstance(layer, KVCache | QuantizedKVCache)]


def recurrent(layers: list[Any]) -> list[Any]:
    return [layer for layer in layers if isinstance(layer, ArraysCache)]


def next_logits(model: Any, state: list[Any], length: int = len(TOKENS)) -> mx.array:
    _, cache = resume(CachedPrefix(state=state, length=length, matched=length), length + 1)
    logits: mx.array = model(mx.array([[7]]), cache=cache)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("quantization", [EIGHT, FOUR, KvQuantization(8, 32)], ids=["8-64", "4-64", "8-32"])
def test_a_snapshot_stores_attention_quantized_and_recurrent_state_exact(
    computed: list[Any], quantization: KvQuantization
) -> None:
    full, full_bytes = compact_copy(computed)
    stored, stored_bytes = compact_copy(computed, quantization=quantization)
    assert [type(layer) for layer in stored] == [
        QuantizedKVCache if type(layer) is KVCache else type(layer) for layer in full
    ]
    expected = full_bytes
    for plain, packed in zip(attention(full), attention(stored), strict=True):
        assert (packed.bits, packed.group_size, packed.offset) == (quantization.bits, quantization.group_size, 40)
        values_shape, scales_shape = quantization.stored_shapes(plain.keys.shape)
        for parts in (packed.keys, packed.values):
            assert [part.shape for part in parts] == [values_shape, scales_shape, scales_shape]
            assert [part.dtype for part in parts] == [mx.uint32, plain.keys.dtype, plain.keys.dtype]
        expected += kv_bytes(plain.keys.shape, plain.keys.dtype.size, quantization) - plain.nbytes
    assert stored_bytes == expected < full_bytes  # what the store is charged: the quantized bytes
    for exact, kept in zip(recurrent(full), recurrent(stored), strict=True):
        assert all(mx.array_equal(a, b).item() for a, b in zip(exact.cache, kept.cache, strict=True))


def test_a_restore_dequantizes_once_into_plain_kv_caches(wide: Any, computed: list[Any]) -> None:
    full, _ = compact_copy(computed)
    stored, _ = compact_copy(computed, quantization=EIGHT)
    start, working = resume(CachedPrefix(state=stored, length=40, matched=40), 41)
    assert start == 40
    assert [type(layer) for layer in working] == [type(layer) for layer in full]
    for plain, restored in zip(attention(full), attention(working), strict=True):
        assert restored.keys.shape == plain.keys.shape and restored.keys.dtype == plain.keys.dtype
        assert restored.offset == 40
        # 8 bits: within a grid step or two of the largest value
        assert mx.all(mx.abs(restored.keys - plain.keys) < mx.max(mx.abs(plain.keys)) / 64).item()
    assert all(isinstance(layer, QuantizedKVCache) for layer in attention(stored))  # the stored copy is untouched
    assert mx.allclose(next_logits(wide[0], stored), next_logits(wide[0], full), atol=0.05).item()


def test_a_dense_restore_trims_the_quantized_state_to_the_matched_tokens(wide: Any, computed: list[Any]) -> None:
    if recurrent(computed):
        pytest.skip("a hybrid state cannot be trimmed")
    stored, _ = compact_copy(computed, quantization=EIGHT)
    start, working = resume(CachedPrefix(state=stored, length=40, matched=25), 30)
    assert start == 25
    assert {layer.offset for layer in working} == {25}
    shorter, _ = compact_copy(computed, 25, quantization=EIGHT)
    again = resume(CachedPrefix(state=shorter, length=25, matched=25), 30)[1]
    for trimmed, cut in zip(working, again, strict=True):  # positions are quantized alone: cutting commutes
        assert mx.array_equal(trimmed.keys[..., :25, :], cut.keys).item()


def test_the_head_dimension_is_measured_for_the_start_up_check(wide: Any) -> None:
    assert attention_head_dims(wide[0]) == (tiny_models.WIDE_HEAD_DIM,)


def write(path: Path, state: list[Any], nbytes: int, trust: FileTrust) -> int:
    return write_snapshot(
        path,
        trust=trust,
        bucket=BUCKET,
        session="s",
        origin=Origin.BOUNDARY,
        prompt_length=len(TOKENS),
        tokens=TOKENS,
        encoded=encode_state(state),
        max_bytes=disk_footprint(nbytes, len(TOKENS)),
    )


def trust_for(model: Any, quantization: KvQuantization | None) -> FileTrust:
    return FileTrust(IDENTITY, KEY, measure_layout(model, quantization), quantization)


@pytest.mark.parametrize("quantization", [EIGHT, FOUR], ids=["8", "4"])
def test_a_quantized_file_reads_back_as_the_state_memory_held(
    wide: Any, computed: list[Any], quantization: KvQuantization, tmp_path: Path
) -> None:
    model = wide[0]
    stored, nbytes = compact_copy(computed, quantization=quantization)
    trust = trust_for(model, quantization)
    path = tmp_path / "q.snap"
    size = write(path, stored, nbytes, trust)
    assert size <= disk_footprint(nbytes, len(TOKENS))
    header, tokens, _ = read_index_entry(path, trust)
    assert (header.quantization, header.nbytes, tokens) == (quantization, nbytes, TOKENS)
    read = read_snapshot(path, trust, ROOM)
    try:
        restored = decode_state(read.header.layout, read.arrays)
    finally:
        read.close()
    assert [type(layer) for layer in restored] == [type(layer) for layer in stored]
    for kept, back in zip(stored, restored, strict=True):
        for a, b in zip(kept.state, back.state, strict=True):
            if isinstance(a, tuple | list):
                assert all((x is None and y is None) or mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
            else:
                assert a == b
    assert mx.array_equal(next_logits(model, restored), next_logits(model, stored)).item()


@pytest.mark.parametrize(
    ("written", "served"),
    [(EIGHT, FOUR), (EIGHT, KvQuantization(8, 32)), (EIGHT, None), (None, EIGHT)],
    ids=["8-as-4", "group-64-as-32", "8-as-computed", "computed-as-8"],
)
def test_a_file_stored_otherwise_is_foreign(
    wide: Any, computed: list[Any], written: KvQuantization | None, served: KvQuantization | None, tmp_path: Path
) -> None:
    model = wide[0]
    state, nbytes = compact_copy(computed, quantization=written)
    path = tmp_path / "x.snap"
    write(path, state, nbytes, trust_for(model, written))
    # The same key and identity: only the header's own statement (and then the layout) tells them apart.
    trust = trust_for(model, served)
    for read in (partial(read_index_entry, path, trust), partial(read_snapshot, path, trust, ROOM)):
        with pytest.raises(UnreadableSnapshot, match="not as this server stores it") as refused:
            read()
        assert refused.value.reason is FileRejection.FOREIGN


def test_a_format_2_file_is_read_as_stored_as_computed(wide: Any, computed: list[Any], tmp_path: Path) -> None:
    """Files of the format before quantized snapshots stay usable where snapshots are stored as computed."""
    model = wide[0]
    state, nbytes = compact_copy(computed)
    path = tmp_path / "old.snap"
    write(path, state, nbytes, trust_for(model, None))
    parts = take_apart(path)
    del parts.header["quantization"]
    path.write_bytes(put_together(parts, key=KEY, version=2))
    assert read_index_entry(path, trust_for(model, None))[0].quantization is None
    read_snapshot(path, trust_for(model, None), ROOM).close()
    with pytest.raises(UnreadableSnapshot) as refused:
        read_index_entry(path, trust_for(model, EIGHT))
    assert refused.value.reason is FileRejection.FOREIGN


def declared(layers: list[Any]) -> tuple[Any, list[DeclaredArray], int]:
    encoded = encode_state(layers)
    arrays: list[DeclaredArray] = []
    offset = 0
    for blob in encoded.arrays:
        arrays.append((blob.dtype, blob.shape, offset, blob.nbytes))
        offset += blob.nbytes
    return copy.deepcopy(encoded.layout), arrays, offset


def resized(arrays: list[DeclaredArray], index: int, shape: tuple[int, ...], dtype: str | None = None) -> int:
    """Array `index` declared with `shape` (and `dtype`), the arrays after it moved: a header whose sizes add up, so
    only the layout check can refuse it. Returns the bytes it adds."""
    name, _, offset, length = arrays[index]
    name = dtype or name
    size = 1
    for dimension in shape:
        size *= dimension
    grown = size * 4 - length  # every array of these states is 4 bytes an element (uint32 or float32)
    arrays[index] = (name, shape, offset, length + grown)
    for later in range(index + 1, len(arrays)):
        other, later_shape, later_offset, later_length = arrays[later]
        arrays[later] = (other, later_shape, later_offset + grown, later_length)
    return grown


def first_quantized(layout: Any) -> dict[str, Any]:
    entry: dict[str, Any] = next(layer for layer in layout if layer["class"] == "QuantizedKVCache")
    return entry


Mutation = Callable[[Any, list[DeclaredArray]], int]


def _packed(width: int, dtype: str | None = None) -> Mutation:
    def change(layout: Any, arrays: list[DeclaredArray]) -> int:
        index = first_quantized(layout)["state"]["list"][0]["list"][0]["array"]
        return resized(arrays, index, (*arrays[index][1][:3], width), dtype)

    return change


def _scales(groups: int) -> Mutation:
    def change(layout: Any, arrays: list[DeclaredArray]) -> int:
        index = first_quantized(layout)["state"]["list"][0]["list"][1]["array"]
        return resized(arrays, index, (*arrays[index][1][:3], groups))

    return change


def _value(at: int, value: Any) -> Mutation:
    def change(layout: Any, arrays: list[DeclaredArray]) -> int:
        first_quantized(layout)["state"]["list"][at] = {"value": value}
        return 0

    return change


def _class(name: str) -> Mutation:
    def change(layout: Any, arrays: list[DeclaredArray]) -> int:
        first_quantized(layout)["class"] = name
        return 0

    return change


def _positions(count: int) -> Mutation:
    """Every array of the first quantized layer declared with `count` positions."""

    def change(layout: Any, arrays: list[DeclaredArray]) -> int:
        state = first_quantized(layout)["state"]["list"]
        grown = 0
        for part in (state[0], state[1]):
            for leaf in part["list"]:
                index = leaf["array"]
                batch, heads, _, last = arrays[index][1]
                grown += resized(arrays, index, (batch, heads, count, last))
        return grown

    return change


@pytest.mark.parametrize(
    ("mutation", "token_count", "why"),
    [
        (_packed(32), 40, "shape"),  # 4-bit packing where 8-bit is served (or 8-bit in a 4-bit slot)
        (_packed(16, "float32"), 40, "float32"),  # the packed values as floats
        (_scales(2), 40, "shape"),  # scales of group 32 where the group is 64
        (_value(3, 32), 40, "32"),  # the layer's group size
        (_value(4, 4), 40, "4"),  # the layer's bits
        (_value(4, "8"), 40, "8"),  # bits as a string
        (_class("KVCache"), 40, "KVCache"),  # packed arrays declared as a plain KV cache
        (_positions(41), 40, "shape"),  # more positions than the file has tokens
        (lambda layout, arrays: _value(2, 42)(layout, arrays) + _positions(41)(layout, arrays), 42, "past its"),
    ],
    ids=["packed-width", "packed-dtype", "scales", "group", "bits", "bits-text", "class", "positions", "offset"],
)
def test_a_quantized_header_the_model_could_not_have_is_refused(
    wide: Any, computed: list[Any], mutation: Mutation, token_count: int, why: str
) -> None:
    layout_of_model: StateLayout = measure_layout(wide[0], EIGHT)
    stored, _ = compact_copy(computed, quantization=EIGHT)
    layout, arrays, nbytes = declared(stored)
    layout_of_model.check(layout, arrays, token_count=40, nbytes=nbytes)  # as written: it passes
    nbytes += mutation(layout, arrays)
    with pytest.raises(LayoutMismatch, match=why):
        layout_of_model.check(layout, arrays, token_count=token_count, nbytes=nbytes)


def test_a_quantized_state_does_not_pass_as_computed_nor_the_reverse(wide: Any, computed: list[Any]) -> None:
    for written, served in ((EIGHT, None), (None, EIGHT), (EIGHT, FOUR)):
        layout, arrays, nbytes = declared(compact_copy(computed, quantization=written)[0])
        with pytest.raises(LayoutMismatch):
            measure_layout(wide[0], served).check(layout, arrays, token_count=40, nbytes=nbytes)


PROMPTS = ("Tell me about the moon and the stars.", "Write a poem about a cat who loves fish.")


@pytest.mark.parametrize("text", PROMPTS)
def test_after_an_8_bit_restore_greedy_output_is_full_precisions_and_4_bit_drift_is_bounded(
    wide: Any, text: str
) -> None:
    """64 generated tokens per prompt, teacher-forced on the full-precision continuation (tests/support/kv_drift.py);
    stored twice: a conversation's carried-over positions are stored again at each turn."""
    model, tokenizer = wide
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    drift = measure(model, prompt, [EIGHT, FOUR], count=64)
    for label in ("8-bit/64", "8-bit/64 x2"):
        assert drift[label].first_divergence is None, drift[label]
        assert drift[label].max_abs_logprob < 0.02, drift[label]
    for label in ("4-bit/64", "4-bit/64 x2"):
        assert drift[label].mean_abs_logprob < 0.05, drift[label]
        assert drift[label].top1_agreement >= 0.9, drift[label]
