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

import mlx.core as mx

from courier.engine.generated_tokens import GeneratedTokens
from courier.engine.generation import SamplingParams


class Penalties:
    """The logits processor of one sequence: it reads the tokens generated since the last step."""

    def __init__(
        self, sampling: SamplingParams, prompt: Sequence[int], generated: GeneratedTokens | None = None
    ) -> None:
        self._presence = sampling.presence_penalty
        self._frequency = sampling.frequency_penalty
        self._repetition = sampling.repetition_penalty
        self._tokens = generated or GeneratedTokens(len(prompt))
        self._generated: Counter[int] = Counter()
        self._counted = 0  # how many of the generated tokens `_generated` counts
        self._seen = set(prompt) if self._repetition != 1.0 else set()
        self._seen_ids: mx.array | None = None
        bias = sampling.logit_bias
        self._bias = (mx.array([t for t, _ in bias]), mx.array([b for _, b in bias])) if bias else None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        tokens = self._tokens.read(context)
        if len(tokens) < self._counted:  # a replay after a fault lost the last step: count again
            self._generated, self._counted = Counter(), 0
        new = tokens[self._counted :]
        self._counted = len(tokens)
        self._generated.update(new)
        if self._repetition != 1.0 and not self._seen.issuperset(new):
            self._seen.update(new)
            self._seen_ids = None
        if self._bias is not None:
            logits = logits.at[:, self._bias[0]].add(self._bias[1])
        if self._repetition != 1.0 and self._seen:
            if self._seen_ids is None:  # rebuilt only when a new token joins (the prompt's can be thousands)
                self._seen_ids = mx.array(sorted(self._seen))
            seen = self._seen_ids
            chosen = logits[:, seen]
            logits[:, seen] = mx.where(chosen < 0, chosen * self._repetition, chosen / self._repetition)
        if (self._presence or self._frequency) and self._generated:
            tokens = list(self._generated)
            counts = mx.array([self._generated[token] for token in tokens], dtype=logits.dtype)
            logits = logits.at[:, mx.array(tokens)].subtract(self._presence + self._frequency * counts)
        return logits
