"""Pooling a generative model's hidden states: the mean over an input's real tokens or its last one, normalized,
whatever the padding after it; checked on a backbone whose hidden state at a token is (id, 1)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from courier.engine.embedding import EmbeddingModel, Pooling, embed_batch, pooled_forward


def backbone(ids: mx.array) -> mx.array:
    return mx.stack([ids.astype(mx.float32), mx.ones(ids.shape)], axis=-1)


def unit(x: float, y: float) -> list[float]:
    length = math.hypot(x, y)
    return [x / length, y / length]


@pytest.mark.parametrize(
    ("pooling", "expected"),
    [(Pooling.MEAN, [unit(2.0, 1.0), unit(5.0, 1.0)]), (Pooling.LAST, [unit(3.0, 1.0), unit(5.0, 1.0)])],
)
def test_pooling_reads_only_the_inputs_own_tokens(pooling: Pooling, expected: list[list[float]]) -> None:
    model = EmbeddingModel(
        forward=pooled_forward(SimpleNamespace(model=backbone), pooling),
        dimensions=2,
        max_tokens=8,
        pooling=pooling.value,
        pad_id=40,  # padding that counted would pull every vector toward (40, 1)
    )
    rows = embed_batch(model, [[1, 2, 3], [5]])
    for row, want in zip(rows, expected, strict=True):
        assert row == pytest.approx(want, abs=1e-6)
