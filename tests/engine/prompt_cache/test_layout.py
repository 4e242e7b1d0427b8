"""A file's declared state checked against the served model's layout, on a dense and a hybrid model: the state the
server writes passes; every declared shape, dtype, layer and size the model could not have is a `LayoutMismatch`,
found with Python integers before anything reaches MLX."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from mlx_lm import load

from courier.engine.model_state import compact_copy, prefill
from courier.engine.prompt_cache.codec import EncodedState, UndecodableState, decode_state, encode_state
from courier.engine.prompt_cache.layout import DeclaredArray, LayoutMismatch, StateLayout, measure_layout

TOKENS = tuple(range(5, 25))
WRAPS = (65536,) * 4  # its int64 product is 2**64: 0


@dataclass(slots=True)
class Declared:
    """What a file's header says about its state."""

    layout: Any
    arrays: list[DeclaredArray]
    token_count: int
    nbytes: int

    def kv_array(self, model: StateLayout) -> int:
        """The first array whose positions grow with the conversation (an attention layer's keys)."""
        return next(index for index, spec in enumerate(model.arrays) if None in spec.shape)

    def resize(self, index: int, shape: tuple[int, ...], *, dtype: str | None = None, itemsize: int = 4) -> None:
        """Array `index` declared with `shape` (and `dtype`), its length that of the shape, the others moved after it:
        a consistent header, so only the layout check can refuse it."""
        old_dtype, _, _, old_length = self.arrays[index]
        length = _product(shape) * itemsize
        self.arrays[index] = (dtype or old_dtype, shape, self.arrays[index][2], length)
        for later in range(index + 1, len(self.arrays)):
            name, later_shape, offset, later_length = self.arrays[later]
            self.arrays[later] = (name, later_shape, offset + length - old_length, later_length)
        self.nbytes += length - old_length


def _product(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def declared(encoded: EncodedState, token_count: int) -> Declared:
    arrays: list[DeclaredArray] = []
    offset = 0
    for blob in encoded.arrays:
        arrays.append((blob.dtype, blob.shape, offset, blob.nbytes))
        offset += blob.nbytes
    return Declared(copy.deepcopy(encoded.layout), arrays, token_count, encoded.nbytes)


@pytest.fixture(scope="module", params=["llama", "qwen3_next"])
def model_layout(request: pytest.FixtureRequest) -> tuple[StateLayout, EncodedState]:
    directory = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen3_next_dir")
    model, _ = load(str(directory))[:2]
    return measure_layout(model), encode_state(compact_copy(prefill(model, TOKENS))[0])


def check(layout: StateLayout, header: Declared) -> None:
    layout.check(header.layout, header.arrays, token_count=header.token_count, nbytes=header.nbytes)


def test_the_state_the_server_writes_fits_its_model(model_layout: tuple[StateLayout, EncodedState]) -> None:
    layout, encoded = model_layout
    check(layout, declared(encoded, len(TOKENS)))
    check(layout, declared(encoded, len(TOKENS) + 7))  # a state may cover fewer tokens than its vector
    with pytest.raises(LayoutMismatch):
        check(layout, declared(encoded, len(TOKENS) - 1))  # never more


def wrapping(layout: StateLayout, header: Declared) -> None:
    """The attack: a layer's keys declared [65536]*4 with 0 bytes, which numpy's int64 product let through."""
    index = header.kv_array(layout)
    header.resize(index, WRAPS)
    header.arrays[index] = (header.arrays[index][0], WRAPS, header.arrays[index][2], 0)


def another_dtype(layout: StateLayout, header: Declared) -> None:
    index = header.kv_array(layout)
    header.resize(index, header.arrays[index][1], dtype="float16", itemsize=2)


def one_more_head(layout: StateLayout, header: Declared) -> None:
    index = header.kv_array(layout)
    batch, heads, positions, dimension = header.arrays[index][1]
    header.resize(index, (batch, heads + 1, positions, dimension))


def another_head_dim(layout: StateLayout, header: Declared) -> None:
    index = header.kv_array(layout)
    batch, heads, positions, dimension = header.arrays[index][1]
    header.resize(index, (batch, heads, positions, dimension * 2))


def more_positions_than_tokens(layout: StateLayout, header: Declared) -> None:
    index = header.kv_array(layout)
    batch, heads, _, dimension = header.arrays[index][1]
    header.resize(index, (batch, heads, header.token_count + 1, dimension))


def a_bool_dimension(layout: StateLayout, header: Declared) -> None:
    name, shape, offset, length = header.arrays[0]
    header.arrays[0] = (name, (True, *shape[1:]), offset, length)


def a_length_its_shape_does_not_have(layout: StateLayout, header: Declared) -> None:
    name, shape, offset, length = header.arrays[-1]
    header.arrays[-1] = (name, shape, offset, length + 4)
    header.nbytes += 4


def overlapping_arrays(layout: StateLayout, header: Declared) -> None:
    name, shape, _, length = header.arrays[1]
    header.arrays[1] = (name, shape, 0, length)


def other_total_bytes(layout: StateLayout, header: Declared) -> None:
    header.nbytes += 1


def one_array_less(layout: StateLayout, header: Declared) -> None:
    header.nbytes -= header.arrays.pop()[3]


def one_layer_less(layout: StateLayout, header: Declared) -> None:
    header.layout.pop()


def another_cache_class(layout: StateLayout, header: Declared) -> None:
    header.layout[0]["class"] = "RotatingKVCache" if header.layout[0]["class"] != "RotatingKVCache" else "KVCache"


def an_offset_past_its_positions(layout: StateLayout, header: Declared) -> None:
    """A KV cache whose offset (still within the token count) is past its arrays' positions."""
    index = header.kv_array(layout)
    positions = header.arrays[index][1][2]
    (items,) = [entry["state"]["list"] for entry in header.layout if entry["state"]["list"][0] == {"array": index}]
    items[2] = {"value": positions + 1}
    header.token_count = positions + 1


def a_float_where_a_count_belongs(layout: StateLayout, header: Declared) -> None:
    for entry in header.layout:
        if entry["class"] == "KVCache":
            entry["state"]["list"][2] = {"value": float(entry["state"]["list"][2]["value"])}


def another_array_in_a_layer(layout: StateLayout, header: Declared) -> None:
    """Two layers' arrays swapped: each has the model's shapes, but not where the model has them."""
    first = header.layout[0]["state"]
    header.layout[0]["state"], header.layout[-1]["state"] = header.layout[-1]["state"], first


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (wrapping, "declares shape"),
        (another_dtype, "is float16"),
        (one_more_head, "declares shape"),
        (another_head_dim, "declares shape"),
        (more_positions_than_tokens, "declares shape"),
        (a_bool_dimension, "declares shape"),
        (a_length_its_shape_does_not_have, "bytes at"),
        (overlapping_arrays, "bytes at"),
        (other_total_bytes, "the arrays take"),
        (one_array_less, "arrays where the model's state has"),
        (one_layer_less, "not the model's .* layers"),
        (another_cache_class, "is not the model's"),
        (an_offset_past_its_positions, "past its"),
        (a_float_where_a_count_belongs, "where a count up to"),
        (another_array_in_a_layer, "where the model has|another length"),
    ],
    ids=lambda value: getattr(value, "__name__", "")[:40],
)
def test_a_state_the_model_could_not_have_is_refused(
    model_layout: tuple[StateLayout, EncodedState], change: Callable[[StateLayout, Declared], None], why: str
) -> None:
    layout, encoded = model_layout
    header = declared(encoded, len(TOKENS))
    change(layout, header)
    with pytest.raises(LayoutMismatch, match=why):
        check(layout, header)


def test_a_layout_that_changes_as_it_grows_is_not_measured(model_layout: tuple[StateLayout, EncodedState]) -> None:
    _, encoded = model_layout
    with pytest.raises(ValueError, match="changes its layers"):
        StateLayout.derive(encoded, EncodedState(layout=encoded.layout[1:], arrays=encoded.arrays))


def test_the_codec_never_builds_a_shape_whose_product_wraps() -> None:
    """Behind the layout check, decoding counts with Python integers too: 0 bytes are not [65536]*4 float32s."""
    layout = [{"class": "KVCache", "state": {"list": [{"array": 0}, {"array": 0}, {"value": 0}]}}]
    with pytest.raises(UndecodableState, match="0 bytes"):
        decode_state(layout, [("float32", WRAPS, memoryview(b""))])
