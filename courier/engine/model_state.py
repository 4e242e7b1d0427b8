"""Compact private copies of a model's per-layer cache, and their size.

An attention KV cache keeps a buffer larger than what it holds (it grows in
steps), and a cache extracted from a batch is a view into the batch's buffers;
a snapshot must hold neither, so each layer is copied down to its contents.
Recurrent (SSM) layer state is copied as it is. Also: resuming from a stored
state, and prefilling a prefix at batch size one (a prefix that requests admitted
together share). Runs on the MLX thread.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

# Tokens per forward pass when prefilling outside the batch generator.
PREFILL_CHUNK = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class CachedPrefix:
    """A stored model state to start from: its first `matched` tokens are the prompt's first tokens."""

    state: Any
    length: int
    matched: int
    # The store entry of this conversation's last completion, which the next completion snapshot supersedes.
    continues: int | None = None


def resume(prefix: CachedPrefix | None, prompt_length: int) -> tuple[int, Any]:
    """How many prompt tokens `prefix` covers, and a private copy of its state trimmed to them (0, None: none)."""
    if prefix is None or not 0 < prefix.matched < prompt_length:
        return 0, None
    cache = copy.deepcopy(prefix.state)
    excess = prefix.length - prefix.matched
    if excess > 0 and (not can_trim_prompt_cache(cache) or trim_prompt_cache(cache, excess) != excess):
        return 0, None
    return prefix.matched, cache


def prefill(model: Any, tokens: Sequence[int], cache: list[Any] | None = None) -> list[Any]:
    """`cache` (a fresh one when None) advanced over `tokens`, at batch size one, evaluated."""
    if cache is None:
        cache = make_prompt_cache(model)
    for start in range(0, len(tokens), PREFILL_CHUNK):
        model(mx.array([list(tokens[start : start + PREFILL_CHUNK])]), cache=cache)
        mx.eval([array for layer in cache for array in state_arrays(layer)])
    return cache


def prefill_embedded(
    model: Any, tokens: Sequence[int], embeddings: mx.array, cache: list[Any] | None, *, start: int, end: int
) -> list[Any]:
    """`cache` advanced over `tokens[start:end]` fed as `embeddings[:, start:end]` (a vision model's merged text
    and image embeddings for the whole prompt), at batch size one, evaluated."""
    if cache is None:
        cache = make_prompt_cache(model)
    for chunk in range(start, end, PREFILL_CHUNK):
        stop = min(chunk + PREFILL_CHUNK, end)
        model(mx.array([list(tokens[chunk:stop])]), cache=cache, input_embeddings=embeddings[:, chunk:stop])
        mx.eval([array for layer in cache for array in state_arrays(layer)])
    return cache


def compact_copy(cache: Sequence[Any], length: int | None = None) -> tuple[list[Any], int]:
    """A private copy of `cache` holding only its contents, and its size in bytes.

    With `length`, only the state after the first `length` tokens: every layer must be a `KVCache`, whose
    first positions are exactly that state.
    """
    copied = [_compact_layer(layer, length) for layer in cache]
    arrays = [array for layer in copied for array in state_arrays(layer)]
    mx.eval(arrays)
    return copied, sum(array.nbytes for array in arrays)


def _compact_layer(layer: Any, length: int | None = None) -> Any:
    copied = copy.copy(layer)
    if isinstance(layer, KVCache):
        if layer.keys is not None:
            used = layer.offset if length is None else min(length, layer.offset)
            copied.keys = mx.contiguous(layer.keys[..., :used, :])
            copied.values = mx.contiguous(layer.values[..., :used, :])
            copied.offset = used
        return copied
    if length is not None:
        raise ValueError(f"cannot cut a {type(layer).__name__} layer to its first {length} tokens")
    copied.state = tree_map(lambda item: mx.contiguous(item) if isinstance(item, mx.array) else item, layer.state)
    return copied


def state_arrays(layer: Any) -> list[mx.array]:
    """The arrays holding one layer's cache contents."""
    if isinstance(layer, KVCache):
        return [array for array in (layer.keys, layer.values) if array is not None]
    return [item for _, item in tree_flatten(layer.state) if isinstance(item, mx.array)]
