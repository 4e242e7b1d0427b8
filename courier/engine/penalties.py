"""Penalties and logit bias: a logits processor per sequence that asks for them (built on the MLX thread).

`presence_penalty` and `frequency_penalty` are OpenAI's: subtracted from the logit of every token the sequence has
generated so far, once (presence) and once per occurrence (frequency); the prompt does not count. A
`repetition_penalty` is vLLM's and Hugging Face's: every token seen in the prompt or the output has its logit
divided by it when positive, multiplied when negative. `logit_bias` adds to the named tokens' logits. A sequence
without any of these gets no processor, so a batch without them runs as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import cast

import mlx.core as mx

from courier.engine.generation import SamplingParams


class Penalties:
    """The logits processor of one sequence: it reads the tokens generated since the last step."""

    def __init__(self, sampling: SamplingParams, prompt: Sequence[int]) -> None:
        self._presence = sampling.presence_penalty
        self._frequency = sampling.frequency_penalty
        self._repetition = sampling.repetition_penalty
        self._position = len(prompt)  # the next context token to read
        self._generated: Counter[int] = Counter()
        self._read: list[int] = []  # generated tokens in order (a replay may take the last ones back)
        self._seen = set(prompt) if self._repetition != 1.0 else set()
        bias = sampling.logit_bias
        self._bias = (mx.array([t for t, _ in bias]), mx.array([b for _, b in bias])) if bias else None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if context.size < self._position:  # a replay after a fault lost the last step: forget what it read
            for token in self._read[context.size - self._position :]:
                self._generated[token] -= 1
            del self._read[context.size - self._position :]
            self._generated = +self._generated  # drop the tokens counted zero times
            self._position = context.size
        if context.size > self._position:
            new = cast("list[int]", context[self._position :].tolist())
            self._position += len(new)
            self._read.extend(new)
            self._generated.update(new)
            if self._repetition != 1.0:
                self._seen.update(new)
        if self._bias is not None:
            logits = logits.at[:, self._bias[0]].add(self._bias[1])
        if self._repetition != 1.0 and self._seen:
            seen = mx.array(sorted(self._seen))
            chosen = logits[:, seen]
            logits[:, seen] = mx.where(chosen < 0, chosen * self._repetition, chosen / self._repetition)
        if (self._presence or self._frequency) and self._generated:
            tokens = list(self._generated)
            counts = mx.array([self._generated[token] for token in tokens], dtype=logits.dtype)
            logits = logits.at[:, mx.array(tokens)].subtract(self._presence + self._frequency * counts)
        return logits
