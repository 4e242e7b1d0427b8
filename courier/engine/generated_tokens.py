"""The tokens one sequence has generated, read from the context mlx-lm hands its logits processors.

Every processor of a sequence (its penalties, its grammar) is given the same context array in a step; reading the
new tokens from it waits for the step that sampled them, so it is done once per step and shared. A context shorter
than what was read is a replay after a fault that lost the last step: those tokens are taken back.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx


class GeneratedTokens:
    def __init__(self, prompt_length: int) -> None:
        self._prompt_length = prompt_length
        self._tokens: list[int] = []
        self._last: mx.array | None = None  # the context read last (one array per step, shared by its processors)

    def read(self, context: mx.array) -> list[int]:
        """Every token generated so far, as of `context` (the prompt and the generated tokens)."""
        if context is not self._last:
            self._last = context
            known = self._prompt_length + len(self._tokens)
            if context.size < known:
                del self._tokens[context.size - self._prompt_length :]
            elif context.size > known:
                self._tokens.extend(cast("list[int]", context[known:].tolist()))
        return self._tokens
