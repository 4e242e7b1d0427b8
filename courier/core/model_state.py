"""Compact private copies of a model's per-layer cache, and their size.

An attention KV cache keeps a buffer larger than what it holds (it grows in
steps), and a cache extracted from a batch is a view into the batch's buffers;
a snapshot must hold neither, so each layer is copied down to its contents.
Recurrent (SSM) layer state is copied as it is. Runs on the MLX thread.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache


def compact_copy(cache: Sequence[Any]) -> tuple[list[Any], int]:
    """A private copy of `cache` holding only its contents, and its size in bytes."""
    copied = [_compact_layer(layer) for layer in cache]
    arrays = [array for layer in copied for array in _arrays(layer)]
    mx.eval(arrays)
    return copied, sum(array.nbytes for array in arrays)


def _compact_layer(layer: Any) -> Any:
    copied = copy.copy(layer)
    if isinstance(layer, KVCache):
        if layer.keys is not None:
            used = layer.offset
            copied.keys = mx.contiguous(layer.keys[..., :used, :])
            copied.values = mx.contiguous(layer.values[..., :used, :])
        return copied
    copied.state = tree_map(lambda item: mx.contiguous(item) if isinstance(item, mx.array) else item, layer.state)
    return copied


def _arrays(layer: Any) -> list[mx.array]:
    if isinstance(layer, KVCache):
        return [array for array in (layer.keys, layer.values) if array is not None]
    return [item for _, item in tree_flatten(layer.state) if isinstance(item, mx.array)]
