"""Per-request samplers for the batch generator (built and run on the MLX thread).

Greedy requests share one sampler object so the batch samples them in one call; so does any request whose
sampling cannot differ from greedy (a temperature under `GREEDY_BELOW_TEMPERATURE`, `top_k` 1).
A request with a `seed` draws each token with a key of its own, made from the seed and
the token's position, so its output does not depend on which other requests share the
batch, on speculative drafts, or on a replay after a fault.

The filters (`top_p`, `min_p`, `top_k`) are plain MLX ops written here, defined for every value a request may
send: a filter keeps at least the most likely token, and one that would keep every token (`top_k` at or past the
vocabulary) changes nothing. mlx-lm's own filters are compiled with MLX's global random state as an input and an
output; one that raised (its `top_k` check) left that state holding a traced array, and every later unseeded draw
in the process failed ("Attempting to eval an array without a primitive"). Nothing here is compiled with that state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from courier.engine.generation import SamplingParams

Sampler = Callable[[mx.array], mx.array]
_WORD = (1 << 64) - 1

# Below this temperature a request decodes greedily (vLLM's `_SAMPLING_EPS`): dividing logits by a denormal
# overflows them to infinities and the draw turns to noise, where the limit of sampling is the argmax.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class Filters:
    """What a draw may choose from, in mlx-lm's order: nucleus (`top_p`), then `min_p`, then `top_k`."""

    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    top_k: int = 0  # 0: off

    def apply(self, logprobs: mx.array) -> mx.array:
        if self.top_p < 1.0:
            logprobs = keep_top_p(logprobs, self.top_p)
        if self.min_p > 0.0:
            logprobs = keep_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = keep_top_k(logprobs, self.top_k)
        return logprobs


def keep_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """The most likely tokens whose mass before each is under `top_p` of the whole: at least the top one, so a
    `top_p` below the top token's mass (1e-300 included) keeps exactly the top token."""
    descending = -mx.sort(-logprobs, axis=-1)
    probs = mx.exp(descending.astype(mx.float32))
    mass_before = mx.cumsum(probs, axis=-1) - probs
    total = mx.sum(probs, axis=-1, keepdims=True)
    kept = mx.maximum((mass_before < top_p * total).sum(axis=-1, keepdims=True), 1)
    threshold = mx.take_along_axis(descending, kept - 1, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def keep_min_p(logprobs: mx.array, min_p: float) -> mx.array:
    """Tokens at least `min_p` times as likely as the top one; at `min_p` 1 only the top one (and its ties)."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + math.log(min_p), -mx.inf, logprobs)


def keep_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """The `top_k` most likely tokens; every token when `top_k` reaches the vocabulary (the same distribution)."""
    vocabulary = logprobs.shape[-1]
    if top_k >= vocabulary:
        return logprobs
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(-mx.inf, logprobs.dtype), axis=-1)


def scaled(logprobs: mx.array, inverse_temperature: float) -> mx.array:
    """Filtered logprobs for a categorical draw at a temperature: in float32 and with the top token at 0 before
    scaling, so no temperature the API allows can overflow them."""
    logprobs = logprobs.astype(mx.float32)
    return (logprobs - mx.max(logprobs, axis=-1, keepdims=True)) * inverse_temperature


def build_sampler(sampling: SamplingParams) -> Sampler:
    """Greedy where sampling cannot differ from it; else the filters, then a categorical draw at the temperature
    (seeded or from MLX's global random state). Raises `ValueError` for a value no request may carry (the HTTP
    layer refuses those first, naming the field)."""
    temperature, top_p, min_p, top_k = sampling.temperature, sampling.top_p, sampling.min_p, sampling.top_k
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, not {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], not {min_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), not {top_k}")
    if temperature < GREEDY_BELOW_TEMPERATURE or top_k == 1:
        return greedy_sampler  # type: ignore[no-any-return]
    filters = Filters(top_p=top_p, min_p=min_p, top_k=top_k)
    if sampling.seed is None:
        return RandomSampler(temperature, filters)
    return SeededSampler(sampling.seed, temperature, filters)


def probe(sampler: Sampler, logprobs: mx.array) -> None:
    """Draw once from `logprobs` and forget the draw (a seeded sampler keeps its position): a replay after a fault
    checks that a sequence can still sample, so one whose sampling raises fails alone. Raises what it raises."""
    position = sampler.position if isinstance(sampler, SeededSampler) else None
    try:
        mx.eval(sampler(logprobs))
    finally:
        if isinstance(sampler, SeededSampler) and position is not None:
            sampler.position = position


class RandomSampler:
    """An unseeded request's draws, from MLX's global random state."""

    def __init__(self, temperature: float, filters: Filters) -> None:
        self.filters = filters
        self._inverse_temperature = 1.0 / temperature

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(scaled(self.filters.apply(logprobs), self._inverse_temperature))


class SeededSampler:
    """A seeded request's own random stream: the draw for its token at `position` (0 for the first generated
    token) uses a key made from the seed and that position. Whoever produces its tokens otherwise sets `position`
    to the next token's: a speculative step after the tokens it kept, a grammar's forced tokens (`skip`), a replay
    after a fault. So the draws are the ones a plain, undisturbed run makes, and a seeded output is the same."""

    def __init__(self, seed: int, temperature: float, filters: Filters | None = None) -> None:
        self._seed = seed
        self.position = 0
        self.filters = filters or Filters()
        self._inverse_temperature = 1.0 / temperature

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
        return mx.random.categorical(scaled(self.filters.apply(logprobs), self._inverse_temperature), key=step_key)
