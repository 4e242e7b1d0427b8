"""Per-request samplers for the batch generator (built and run on the MLX thread).

Greedy requests share one sampler object so the batch samples them in one call.
A request with a `seed` gets its own PRNG key, split at every token, so its output
does not depend on which other requests share the batch, nor on speculative drafts.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_sampler

Sampler = Callable[[mx.array], mx.array]


def build_sampler(temperature: float, top_p: float, seed: int | None, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Greedy at temperature 0 (top_k and min_p then change nothing); else top_p, min_p and top_k filter the
    distribution, in mlx-lm's order, before a categorical draw."""
    if temperature == 0:
        return greedy_sampler  # type: ignore[no-any-return]
    if seed is None:
        return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)  # type: ignore[no-any-return]
    return SeededSampler(seed, temperature, top_p, top_k=top_k, min_p=min_p)


class SeededSampler:
    """A seeded request's own random stream: its key is split once per token, so its output does not depend on
    which requests share its batch. A speculative step reads `key` before drawing for a draft's positions and sets
    it back to the key after the last token it keeps, so a seeded output is the same with or without drafts."""

    def __init__(self, seed: int, temperature: float, top_p: float, *, top_k: int = 0, min_p: float = 0.0) -> None:
        self.key = mx.random.key(seed)
        self._inverse_temperature = 1.0 / temperature
        self._top_p, self._top_k, self._min_p = top_p, top_k, min_p

    def skip(self, tokens: int) -> None:
        """Pass over the draws of `tokens` tokens appended without drawing (a grammar forced them)."""
        for _ in range(tokens):
            self.key = mx.random.split(self.key)[0]

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, step_key = mx.random.split(self.key)
        if 0 < self._top_p < 1:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._min_p > 0:
            logprobs = apply_min_p(logprobs, self._min_p)
        if self._top_k > 0:
            logprobs = apply_top_k(logprobs, self._top_k)
        return mx.random.categorical(logprobs * self._inverse_temperature, key=step_key)
