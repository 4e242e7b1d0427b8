"""A model state (mlx-lm's per-layer cache objects) as a layout and flat byte buffers, and back.

Encoding runs on the MLX thread and copies nothing: each array is viewed as bytes
(a memoryview the file writer reads on its own thread, kept alive by the view).
Decoding runs on the MLX thread too and is the one copy a restore needs: from the
file's bytes, read into memory by a worker thread, into new arrays. The layout is plain JSON: per layer, its cache
class (only `mlx_lm.models.cache`'s own classes are ever built back) and its
`state` tree, arrays replaced by their index in the buffer list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_module

_ARRAY, _LIST, _DICT, _VALUE = "array", "list", "dict", "value"


class UndecodableState(ValueError):
    """A layout that does not describe a model state this server can build."""


@dataclass(frozen=True, slots=True)
class ArrayBlob:
    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # the array's bytes, C order

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True, slots=True)
class EncodedState:
    layout: list[Any]  # JSON: one {"class": name, "state": tree} per layer
    arrays: list[ArrayBlob]

    @property
    def nbytes(self) -> int:
        return sum(blob.nbytes for blob in self.arrays)


def encode_state(layers: Sequence[Any]) -> EncodedState:
    """On the MLX thread: `layers` (evaluated cache objects) as a layout and byte views of their arrays."""
    arrays: list[mx.array] = []
    for layer in layers:
        if type(layer).__module__ != cache_module.__name__:
            raise TypeError(f"{type(layer).__module__}.{type(layer).__name__} is not an mlx-lm cache: not written")
    layout = [{"class": type(layer).__name__, "state": _encode_tree(layer.state, arrays)} for layer in layers]
    flat = [array.reshape(-1).view(mx.uint8) if array.size else array.reshape(-1) for array in arrays]
    mx.eval(flat)
    blobs = [
        ArrayBlob(dtype=_dtype_name(array.dtype), shape=tuple(array.shape), data=_bytes_of(view))
        for array, view in zip(arrays, flat, strict=True)
    ]
    return EncodedState(layout=layout, arrays=blobs)


def decode_state(layout: Any, arrays: Sequence[tuple[str, Sequence[int], memoryview]]) -> list[Any]:
    """On the MLX thread: cache objects built from `layout` and `arrays` (dtype name, shape, bytes), evaluated.
    Raises `UndecodableState` for anything that is not a state this server could have written."""
    built = [_decode_array(dtype, shape, data) for dtype, shape, data in arrays]
    if not isinstance(layout, list):
        raise UndecodableState("the layout is not a list of layers")
    layers = [_decode_layer(entry, built) for entry in layout]
    mx.eval(built)
    return layers


def _encode_tree(node: Any, arrays: list[mx.array]) -> Any:
    if isinstance(node, mx.array):
        arrays.append(node)
        return {_ARRAY: len(arrays) - 1}
    if isinstance(node, list | tuple):
        return {_LIST: [_encode_tree(item, arrays) for item in node]}
    if isinstance(node, dict):
        return {_DICT: {str(key): _encode_tree(value, arrays) for key, value in node.items()}}
    if node is None or isinstance(node, bool | int | float | str):
        return {_VALUE: node}
    raise TypeError(f"a model state holds a {type(node).__name__}, which cannot be written to disk")


def _decode_tree(node: Any, arrays: list[mx.array]) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise UndecodableState(f"not a state node: {str(node)[:80]}")
    ((kind, value),) = node.items()
    if kind == _ARRAY and isinstance(value, int) and 0 <= value < len(arrays):
        return arrays[value]
    if kind == _LIST and isinstance(value, list):
        return [_decode_tree(item, arrays) for item in value]
    if kind == _DICT and isinstance(value, dict):
        return {key: _decode_tree(item, arrays) for key, item in value.items()}
    if kind == _VALUE and (value is None or isinstance(value, bool | int | float | str)):
        return value
    raise UndecodableState(f"not a state node: {str(node)[:80]}")


def _decode_layer(entry: Any, arrays: list[mx.array]) -> Any:
    if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
        raise UndecodableState("a layer without a cache class")
    name = entry["class"]
    kind = getattr(cache_module, name, None)
    if not (isinstance(kind, type) and issubclass(kind, cache_module._BaseCache)):
        raise UndecodableState(f"{name!r} is not an mlx-lm cache class")
    try:
        return kind.from_state(_decode_tree(entry.get("state"), arrays))  # type: ignore[attr-defined]
    except (TypeError, ValueError) as error:
        raise UndecodableState(f"a {name} layer's state does not fit it: {error}") from error


def _decode_array(dtype_name: str, shape: Sequence[int], data: memoryview) -> mx.array:
    dtype = getattr(mx, dtype_name, None)
    if not isinstance(dtype, mx.Dtype) or not all(isinstance(size, int) and size >= 0 for size in shape):
        raise UndecodableState(f"not an array: {dtype_name} {list(shape)}")
    count = math.prod(shape)  # Python integers: numpy's int64 product of [65536] * 4 wraps to 0
    if count * dtype.size != data.nbytes:
        raise UndecodableState(f"{data.nbytes} bytes for a {dtype_name} array of shape {list(shape)}")
    if count == 0:
        return mx.zeros(tuple(shape), dtype=dtype)
    raw = mx.array(np.frombuffer(data, dtype=np.uint8))
    return raw.view(dtype).reshape(tuple(shape))


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _bytes_of(view: mx.array) -> memoryview:
    if view.size == 0:
        return memoryview(b"")
    return memoryview(view).cast("B")  # type: ignore[arg-type]  # mx.array exports the buffer protocol
