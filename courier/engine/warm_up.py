"""Idle warm-up: extend a conversation's model state over the reply just given, on the MLX thread.

After a turn, the next turn's prompt starts with the history through that reply,
re-rendered by the chat template. Prefilling it while the server is idle lets the
next turn prefill only its new message. The work is done in small chunks so the
scheduler can stop it the moment live requests arrive.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from courier.core.prompt_cache.entries import Origin
from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.engine_io import SnapshotTaken
from courier.engine.model_state import CachedPrefix, compact_copy, resume, state_arrays

CHUNK_TOKENS = 64


class WarmUp:
    def __init__(
        self,
        model: Any,
        tokens: tuple[int, ...],
        prefix: CachedPrefix | None,
        quantization: KvQuantization | None = None,
    ) -> None:
        self._model = model
        self._tokens = tokens
        self._quantization = quantization  # how its snapshot stores attention KV
        start, cache = resume(prefix, len(tokens) + 1)
        self._cache = cache if cache is not None else make_prompt_cache(model)
        self._done = start

    @property
    def finished(self) -> bool:
        return self._done >= len(self._tokens)

    def advance(self) -> None:
        """Prefill the next chunk."""
        chunk = self._tokens[self._done : self._done + CHUNK_TOKENS]
        self._model(mx.array([chunk]), cache=self._cache)
        mx.eval([array for layer in self._cache for array in state_arrays(layer)])
        self._done += len(chunk)

    def snapshot(self) -> SnapshotTaken:
        state, nbytes = compact_copy(self._cache, quantization=self._quantization)
        return SnapshotTaken(origin=Origin.BOUNDARY, tokens=self._tokens, state=state, nbytes=nbytes)
