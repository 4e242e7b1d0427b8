"""The served model's state layout, and a snapshot file's declared state checked against it before MLX sees it.

The model's cache is measured once at start-up, on the MLX thread, after 2 and
after 3 prompt tokens: every layer's cache class and state tree, and every array's
dtype and shape. A dimension (or an integer in the tree, such as a KV cache's
offset) that differs between the two grows with the conversation: in a file it may
be anything from 0 to the file's token count. Everything else (layer kinds, head
counts, head dimension, dtypes, recurrent state sizes) must be exactly the model's.
A file's header is checked with Python integers and every dimension bounded, so a
declared shape whose int64 product would wrap, a dtype or head count the model does
not have, an array length that does not match its shape, or arrays that do not tile
the payload are a `LayoutMismatch`, never a failure inside MLX. With quantized
snapshots (`--prompt-cache-bits`) the layout is measured on the stored form: an
attention layer is a `QuantizedKVCache` whose keys and values are uint32 packed
values, scales and biases (shapes per `core/prompt_cache/quantization.py`), its group
size and bits exactly the served ones. Only `measure_layout` touches MLX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from courier.core.prompt_cache.quantization import STORED_CLASS, KvQuantization
from courier.engine.model_state import compact_copy, prefill
from courier.engine.prompt_cache.codec import EncodedState, encode_state

_ARRAY, _LIST, _DICT, _VALUE = "array", "list", "dict", "value"
_GROWS = "grows"  # in a layout template: an integer that grows with the conversation (0 to its token count)
_PROBE_TOKENS = (2, 3)
# Bytes per element of each MLX dtype a state can hold.
ITEM_SIZES = {
    "bool_": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
}
# A declared array: dtype name, shape, offset in the arrays' part, length in bytes (as a file's header says).
DeclaredArray = tuple[str, tuple[int, ...], int, int]


class LayoutMismatch(ValueError):
    """A declared state that is not one the served model could have."""


@dataclass(frozen=True, slots=True)
class ArraySpec:
    dtype: str
    shape: tuple[int | None, ...]  # None: a dimension that grows with the conversation

    @property
    def itemsize(self) -> int:
        return ITEM_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class StateLayout:
    layers: tuple[Any, ...]  # per layer {"class": name, "state": tree}, growing integers marked `_GROWS`
    arrays: tuple[ArraySpec, ...]

    @classmethod
    def derive(cls, short: EncodedState, long: EncodedState) -> StateLayout:
        """The layout two encodings of one model's state (after fewer and more tokens) share. Raises `ValueError`
        when they do not describe one layout."""
        if len(short.layout) != len(long.layout) or len(short.arrays) != len(long.arrays):
            raise ValueError("the model's state changes its layers as it grows")
        layers = tuple(_template_layer(a, b) for a, b in zip(short.layout, long.layout, strict=True))
        arrays = []
        for a, b in zip(short.arrays, long.arrays, strict=True):
            if a.dtype != b.dtype or len(a.shape) != len(b.shape) or a.dtype not in ITEM_SIZES:
                raise ValueError(f"the model's state holds {a.dtype} {a.shape} and then {b.dtype} {b.shape}")
            grown = tuple(x if x == y else None for x, y in zip(a.shape, b.shape, strict=True))
            arrays.append(ArraySpec(a.dtype, grown))
        return cls(layers=layers, arrays=tuple(arrays))

    def check(self, layout: Any, arrays: Sequence[DeclaredArray], *, token_count: int, nbytes: int) -> None:
        """Raise `LayoutMismatch` unless `layout` and `arrays` (a file's header) describe a state of this model
        covering at most `token_count` tokens, whose arrays tile exactly `nbytes` bytes."""
        if len(arrays) != len(self.arrays):
            raise LayoutMismatch(f"{len(arrays)} arrays where the model's state has {len(self.arrays)}")
        offset = 0
        for index, ((dtype, shape, start, length), spec) in enumerate(zip(arrays, self.arrays, strict=True)):
            if dtype != spec.dtype or len(shape) != len(spec.shape):
                raise LayoutMismatch(f"array {index} is {dtype} of rank {len(shape)}, not {spec.dtype} {spec.shape}")
            for size, expected in zip(shape, spec.shape, strict=True):
                bound = token_count if expected is None else expected
                if not _is_count(size) or size > bound or (expected is not None and size != expected):
                    raise LayoutMismatch(f"array {index} declares shape {list(shape)}; the model's is {spec.shape}")
            if start != offset or length != math.prod(shape) * spec.itemsize:
                raise LayoutMismatch(f"array {index} declares {length} bytes at {start} for shape {list(shape)}")
            offset += length
        if offset != nbytes:
            raise LayoutMismatch(f"the arrays take {offset} bytes where the header says {nbytes}")
        if not isinstance(layout, list) or len(layout) != len(self.layers):
            raise LayoutMismatch(f"a layout that is not the model's {len(self.layers)} layers")
        for index, (entry, expected) in enumerate(zip(layout, self.layers, strict=True)):
            _check_layer(index, entry, expected=expected, arrays=arrays, token_count=token_count, specs=self.arrays)


def measure_layout(model: Any, quantization: KvQuantization | None = None) -> StateLayout:
    """On the MLX thread: the layout of the model's state as stored, from its cache after a few prompt tokens."""
    short, long = (
        encode_state(compact_copy(prefill(model, [0] * count), quantization=quantization)[0]) for count in _PROBE_TOKENS
    )
    return StateLayout.derive(short, long)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _template_layer(a: Any, b: Any) -> dict[str, Any]:
    if a.get("class") != b.get("class"):
        raise ValueError(f"a layer of the model's state is a {a.get('class')} and then a {b.get('class')}")
    return {"class": a["class"], "state": _template(a["state"], b["state"])}


def _template(a: Any, b: Any) -> Any:
    """The state node both encodings have, integers that differ marked as growing."""
    ((kind, x),) = a.items()
    ((other_kind, y),) = b.items()
    if kind == other_kind == _VALUE:
        if type(x) is type(y) and x == y:
            return {_VALUE: x}
        if _is_count(x) and _is_count(y):
            return {_GROWS: None}
    elif kind == other_kind == _ARRAY and x == y:
        return {_ARRAY: x}
    elif kind == other_kind == _LIST and len(x) == len(y):
        return {_LIST: [_template(item, other) for item, other in zip(x, y, strict=True)]}
    elif kind == other_kind == _DICT and x.keys() == y.keys():
        return {_DICT: {key: _template(x[key], y[key]) for key in x}}
    raise ValueError(f"the model's state changes its shape as it grows: {str(a)[:80]} / {str(b)[:80]}")


def _check_layer(
    index: int,
    entry: Any,
    *,
    expected: Any,
    arrays: Sequence[DeclaredArray],
    token_count: int,
    specs: Sequence[ArraySpec],
) -> None:
    if not isinstance(entry, dict) or entry.keys() != expected.keys() or entry["class"] != expected["class"]:
        raise LayoutMismatch(f"layer {index} is not the model's {expected['class']}")
    _check_node(index, entry["state"], expected["state"], token_count)
    kv = _kv_arrays(expected["class"], expected["state"], specs)
    if kv is not None:
        # A KV cache whose offset is past its arrays' positions fails on its next update: offset <= positions.
        items = entry["state"][_LIST]
        offset = items[kv]
        positions = min(arrays[leaf[_ARRAY]][1][2] for leaf in _leaves(items[:kv]))
        if offset[_VALUE] > positions:
            raise LayoutMismatch(f"layer {index} declares offset {offset[_VALUE]} past its {positions} positions")


def _check_node(layer: int, node: Any, expected: Any, token_count: int) -> None:
    if not isinstance(node, dict) or len(node) != 1:
        raise LayoutMismatch(f"layer {layer}: not a state node: {str(node)[:80]}")
    ((kind, value),) = node.items()
    ((expected_kind, expected_value),) = expected.items()
    if expected_kind == _GROWS:
        if kind != _VALUE or not _is_count(value) or value > token_count:
            raise LayoutMismatch(f"layer {layer}: {str(node)[:80]} where a count up to {token_count} belongs")
        return
    if kind != expected_kind:
        raise LayoutMismatch(f"layer {layer}: a {kind} node where the model has a {expected_kind}")
    if kind in (_ARRAY, _VALUE):
        if type(value) is not type(expected_value) or value != expected_value:
            raise LayoutMismatch(f"layer {layer}: {kind} {str(value)[:40]} where the model has {expected_value!r}")
    elif kind == _LIST:
        if not isinstance(value, list) or len(value) != len(expected_value):
            raise LayoutMismatch(f"layer {layer}: a list of another length than the model's")
        for item, expected_item in zip(value, expected_value, strict=True):
            _check_node(layer, item, expected_item, token_count)
    else:
        if not isinstance(value, dict) or value.keys() != expected_value.keys():
            raise LayoutMismatch(f"layer {layer}: a dict with other keys than the model's")
        for key, item in value.items():
            _check_node(layer, item, expected_value[key], token_count)


def _kv_arrays(name: str, state: Any, specs: Sequence[ArraySpec]) -> int | None:
    """Where the offset is in mlx-lm's KV cache state as this server writes it (keys and values, each an array or a
    quantized triple with positions growing on axis 2, then the offset): None for any other state."""
    items = state.get(_LIST)
    if name not in ("KVCache", STORED_CLASS) or not isinstance(items, list) or len(items) < 3:
        return None
    if next(iter(items[2])) != _GROWS:
        return None
    leaves = _leaves(items[:2])
    if name == STORED_CLASS and (len(leaves) != 6 or any(_LIST not in item for item in items[:2])):
        return None
    if name == "KVCache" and [next(iter(item)) for item in items] != [_ARRAY, _ARRAY, _GROWS]:
        return None
    shapes = [specs[leaf[_ARRAY]].shape for leaf in leaves]
    return 2 if all(len(shape) == 4 and shape[2] is None for shape in shapes) else None


def _leaves(nodes: Sequence[Any]) -> list[Any]:
    """The array nodes among `nodes` and inside their lists (one level: a quantized triple)."""
    leaves: list[Any] = []
    for node in nodes:
        if _ARRAY in node:
            leaves.append(node)
        elif _LIST in node:
            leaves.extend(item for item in node[_LIST] if _ARRAY in item)
    return leaves
