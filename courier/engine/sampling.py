"""Per-request samplers for the batch generator (built and run on the MLX thread).

Greedy requests share one sampler object so the batch samples them in one call.
A request with a `seed` gets its own PRNG key, split at every step, so its output
does not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, greedy_sampler, make_sampler

Sampler = Callable[[mx.array], mx.array]


def build_sampler(temperature: float, top_p: float, seed: int | None) -> Sampler:
    if temperature == 0:
        return greedy_sampler  # type: ignore[no-any-return]
    if seed is None:
        return make_sampler(temp=temperature, top_p=top_p)  # type: ignore[no-any-return]
    key = mx.random.key(seed)
    inverse_temperature = 1.0 / temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inverse_temperature, key=step_key)

    return sample
