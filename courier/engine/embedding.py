"""Embedding vectors from a model, on the MLX thread: one padded batch in, one unit vector per input out.

Two kinds of model embed. An embedding model (BERT, ModernBERT, XLM-RoBERTa, Qwen3-Embedding, ...) runs through
mlx-embeddings, whose model pools and normalizes by its own recipe (`text_embeds`). A generative mlx-lm model embeds
only when the operator enables pooling for it (`--embedding-pooling`): its last hidden states (before the LM head)
are pooled, by the mean over the input's tokens or its last token, then normalized. Inputs are right-padded with a
mask; a causal model's real tokens never attend to the padding after them, so pooling over the mask is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx

# Below this, a vector's norm is taken to be this (a zero vector stays zero rather than dividing by zero).
NORM_FLOOR = 1e-9


class Pooling(Enum):
    MEAN = "mean"
    LAST = "last"


Forward = Callable[[mx.array, mx.array], mx.array]  # (ids (B, T), mask (B, T)) -> unit vectors (B, D)


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingModel:
    """What embeds: the forward pass, the vectors' width, the longest input, and how it pools (for /v1/models)."""

    forward: Forward
    dimensions: int
    max_tokens: int
    pooling: str  # "model" (the embedding model's own recipe), "mean" or "last"
    pad_id: int = 0


def encoder_forward(model: Any) -> Forward:
    """An mlx-embeddings model: its own pooled, normalized `text_embeds`."""

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        embeds: mx.array = model(ids, attention_mask=mask).text_embeds
        return embeds

    return forward


def pooled_forward(model: Any, pooling: Pooling) -> Forward:
    """A generative mlx-lm model: its backbone's last hidden states (`model.model`), pooled and normalized."""
    backbone = model.model

    def forward(ids: mx.array, mask: mx.array) -> mx.array:
        hidden = backbone(ids).astype(mx.float32)
        if pooling is Pooling.LAST:
            last = mask.sum(axis=1).astype(mx.int32) - 1
            pooled = hidden[mx.arange(hidden.shape[0]), last]
        else:
            weights = mask.astype(mx.float32)[:, :, None]
            pooled = (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)
        return normalized(pooled)

    return forward


def normalized(vectors: mx.array) -> mx.array:
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, NORM_FLOOR)


def embed_batch(model: EmbeddingModel, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
    """On the MLX thread: the unit vectors of `inputs` (each non-empty, at most `max_tokens` long), in order."""
    width = max(len(tokens) for tokens in inputs)
    ids = [list(tokens) + [model.pad_id] * (width - len(tokens)) for tokens in inputs]
    mask = [[1] * len(tokens) + [0] * (width - len(tokens)) for tokens in inputs]
    vectors = model.forward(mx.array(ids, dtype=mx.int32), mx.array(mask, dtype=mx.int32)).astype(mx.float32)
    mx.eval(vectors)
    rows: list[list[float]] = vectors.tolist()  # type: ignore[assignment]
    return rows
