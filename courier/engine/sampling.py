"""Per-request samplers for the batch generator (built and run on the MLX thread).

Greedy requests share one sampler object so the batch samples them in one call.
A request with a `seed` draws each token with a key of its own, made from the seed and
the token's position, so its output does not depend on which other requests share the
batch, on speculative drafts, or on a replay after a fault.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler, make_sampler

Sampler = Callable[[mx.array], mx.array]
_WORD = (1 << 64) - 1


def build_sampler(temperature: float, top_p: float, seed: int | None, top_k: int = 0, min_p: float = 0.0) -> Sampler:
    """Greedy at temperature 0 (top_k and min_p then change nothing); else top_p, min_p and top_k filter the
    distribution, in mlx-lm's order, before a categorical draw."""
    if temperature == 0:
        return greedy_sampler  # type: ignore[no-any-return]
    if seed is None:
        return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)  # type: ignore[no-any-return]
    return SeededSampler(seed, temperature, top_p, top_k=top_k, min_p=min_p)


class SeededSampler:
    """A seeded request's own random stream: the draw for its token at `position` (0 for the first generated
    token) uses a key made from the seed and that position. Whoever produces its tokens otherwise sets `position`
    to the next token's: a speculative step after the tokens it kept, a grammar's forced tokens (`skip`), a replay
    after a fault. So the draws are the ones a plain, undisturbed run makes, and a seeded output is the same."""

    def __init__(self, seed: int, temperature: float, top_p: float, *, top_k: int = 0, min_p: float = 0.0) -> None:
        self._seed = seed
        self.position = 0
        self._inverse_temperature = 1.0 / temperature
        self._top_p, self._top_k, self._min_p = top_p, top_k, min_p

    def skip(self, tokens: int) -> None:
        """Pass over the draws of `tokens` tokens appended without drawing (a grammar forced them)."""
        self.position += tokens

    def key(self, position: int) -> mx.array:
        """The key of the draw at `position` (splitmix64 of seed and position: distinct, deterministic streams)."""
        mixed = (self._seed * 0x9E3779B97F4A7C15 + position + 1) & _WORD
        mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _WORD
        mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _WORD
        return mx.random.key(mixed ^ (mixed >> 31))

    def __call__(self, logprobs: mx.array) -> mx.array:
        step_key = self.key(self.position)
        self.position += 1
        if 0 < self._top_p < 1:
            logprobs = apply_top_p(logprobs, self._top_p)
        if self._min_p > 0:
            logprobs = apply_min_p(logprobs, self._min_p)
        if self._top_k > 0:
            logprobs = apply_top_k(logprobs, self._top_k)
        return mx.random.categorical(logprobs * self._inverse_temperature, key=step_key)
