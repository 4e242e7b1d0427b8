"""Compact private copies of a model's per-layer cache, and their size.

An attention KV cache keeps a buffer larger than what it holds (it grows in
steps), and a cache extracted from a batch is a view into the batch's buffers;
a snapshot must hold neither, so each layer is copied down to its contents.
Recurrent (SSM) layer state is copied as it is. A snapshot for the store may be
quantized on the way (`--prompt-cache-bits`): its attention layers become mlx-lm
`QuantizedKVCache`s, dequantized once when a request resumes from them. Also:
resuming from a stored state, and prefilling a prefix at batch size one (a prefix
that requests admitted together share). Runs on the MLX thread.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from courier.core.prompt_cache.quantization import KvQuantization

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
    """How many prompt tokens `prefix` covers, and a private copy of its state trimmed to them (0, None: none).
    Quantized attention layers come back dequantized: the batch computes with plain KV caches."""
    if prefix is None or not 0 < prefix.matched < prompt_length:
        return 0, None
    cache = [_working_layer(layer) for layer in prefix.state]
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


def attention_head_dims(model: Any) -> tuple[int, ...]:
    """On the MLX thread: the head dimensions of the keys and values of the model's plain attention (`KVCache`)
    layers, the ones quantized snapshots quantize (none: the model has no such layer)."""
    cache = prefill(model, [0, 0])
    dims = {array.shape[-1] for layer in cache if type(layer) is KVCache for array in state_arrays(layer)}
    return tuple(sorted(dims))


def compact_copy(
    cache: Sequence[Any], length: int | None = None, *, quantization: KvQuantization | None = None
) -> tuple[list[Any], int]:
    """A private copy of `cache` holding only its contents, and its size in bytes.

    With `length`, only the state after the first `length` tokens: every layer must be a `KVCache`, whose
    first positions are exactly that state. With `quantization`, attention (`KVCache`) layers are stored as
    `QuantizedKVCache`s; every other layer stays exact.
    """
    copied = [_compact_layer(layer, length, quantization) for layer in cache]
    arrays = [array for layer in copied for array in state_arrays(layer)]
    mx.eval(arrays)
    return copied, sum(array.nbytes for array in arrays)


def _compact_layer(layer: Any, length: int | None = None, quantization: KvQuantization | None = None) -> Any:
    if quantization is not None and type(layer) is KVCache and layer.keys is not None:
        used = layer.offset if length is None else min(length, layer.offset)
        return _quantized(layer.keys[..., :used, :], layer.values[..., :used, :], used, quantization)
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


def _quantized(keys: mx.array, values: mx.array, offset: int, quantization: KvQuantization) -> QuantizedKVCache:
    stored = QuantizedKVCache(group_size=quantization.group_size, bits=quantization.bits)
    stored.keys = tuple(mx.quantize(keys, group_size=quantization.group_size, bits=quantization.bits))
    stored.values = tuple(mx.quantize(values, group_size=quantization.group_size, bits=quantization.bits))
    stored.offset = offset
    return stored


def _working_layer(layer: Any) -> Any:
    """A private copy of a stored layer to compute with: a quantized one dequantized into a plain KV cache."""
    if not isinstance(layer, QuantizedKVCache):
        return copy.deepcopy(layer)
    working = KVCache()
    if layer.keys is not None:
        used = layer.offset
        keys, values = (
            _dequantized([part[..., :used, :] for part in parts], layer) for parts in (layer.keys, layer.values)
        )
        working.keys, working.values, working.offset = keys, values, used
    return working


def _dequantized(parts: Sequence[mx.array], layer: QuantizedKVCache) -> mx.array:
    packed, scales, biases = parts
    return mx.dequantize(packed, scales, biases, group_size=layer.group_size, bits=layer.bits)


def state_arrays(layer: Any) -> list[mx.array]:
    """The arrays holding one layer's cache contents."""
    if isinstance(layer, KVCache):
        return [array for array in (layer.keys, layer.values) if array is not None]
    return [item for _, item in tree_flatten(layer.state) if isinstance(item, mx.array)]
