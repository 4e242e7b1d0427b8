"""Prompt-lookup drafts: what followed the last time a sequence's latest n-gram appeared in its own context.

Agents' outputs repeat their inputs (a file returned with a small edit, a quoted passage, JSON that carries the
user's values), so the tokens that followed an earlier occurrence of the last few tokens are often the tokens the
model is about to produce. A `PromptLookup` keeps one index per n-gram length, from each n-gram of the sequence's
prompt and output to where the tokens after its most recent occurrence start, and proposes `max_draft` tokens
from the longest n-gram that matches (`max_ngram` down to `MIN_NGRAM`); a continuation that runs into the end of
the context is a loop, and repeats.

How many of a draft's tokens are verified is the engine's choice (`verify_width.best_width`, from the cost of a
wider pass and the sequence's acceptance). The lookup estimates that acceptance (the chance a draft token is kept,
given the ones before it were) from recent drafts, weighed most, and keeps it up to date on steps that verify
nothing too: a `shadow` draft is proposed and never verified, and the tokens the sequence goes on with say how
much of it would have been kept. So a sequence whose drafts miss (nothing to copy, or an edit the copy diverges at)
is soon expected to gain little and is not verified, and one that starts copying again is seen to, without paying
for a failed verify to find out. Pure Python: the engine verifies drafts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MIN_NGRAM = 2
# Acceptance is estimated from recent drafts (older ones weigh this much less per draft), from a prior of 1 in 2.
ACCEPTANCE_DECAY = 0.8


@dataclass(frozen=True, slots=True)
class LookupLimits:
    max_ngram: int  # the longest n-gram matched (at least MIN_NGRAM)
    max_draft: int  # the most tokens proposed at once

    def __post_init__(self) -> None:
        if self.max_ngram < MIN_NGRAM:
            raise ValueError(f"max_ngram must be at least {MIN_NGRAM}")
        if self.max_draft < 1:
            raise ValueError("max_draft must be at least 1")


class PromptLookup:
    """One sequence's n-gram index over its context, and its drafting schedule."""

    def __init__(self, context: Sequence[int], limits: LookupLimits) -> None:
        self._limits = limits
        self._tokens: list[int] = []
        # _index[n - MIN_NGRAM]: n-gram -> where the tokens after its most recent occurrence start.
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(MIN_NGRAM, limits.max_ngram + 1)]
        self._kept, self._refused = 1.0, 1.0  # decayed counts of draft tokens kept, and of drafts cut short
        self._shadow: list[int] = []  # a draft not verified, checked against the tokens that follow
        self._shadow_kept = 0
        self.extend(context)

    @property
    def draft_length(self) -> int:
        """How many tokens a draft has (when it finds a match)."""
        return self._limits.max_draft

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept, given the ones before it were (recent drafts)."""
        return self._kept / (self._kept + self._refused)

    def extend(self, tokens: Iterable[int]) -> None:
        """The sequence went on with `tokens` (its prompt first, then what it generated)."""
        for token in tokens:
            if self._shadow:
                self._check_shadow(token)
            self._tokens.append(token)
            end = len(self._tokens) - 1  # the new token's position: it follows the n-grams that end just before it
            for n, index in enumerate(self._index, start=MIN_NGRAM):
                if end >= n:
                    index[tuple(self._tokens[end - n : end])] = end

    def may_propose(self) -> bool:
        """Whether a draft is likely after the next token: the context as it stands has a match (cheap, no copy)."""
        return self._find(self._tokens) is not None

    def shadow(self) -> None:
        """Draft after the context as it stands without verifying it (unless a shadow draft is being checked):
        the tokens that follow are recorded against it as a verified draft's would be."""
        if not self._shadow:
            self._shadow, self._shadow_kept = self.propose(), 0

    def propose(self, next_token: int | None = None) -> list[int]:
        """`max_draft` tokens to follow the context (and `next_token`, not yet added), or none without a match."""
        self._shadow = []  # a draft to verify replaces any shadow one
        tokens = self._tokens if next_token is None else [*self._tokens[-self._limits.max_ngram :], next_token]
        start = self._find(tokens)
        if start is None:
            return []
        length = self._limits.max_draft
        draft = self._tokens[start : start + length]
        if len(draft) < length:  # it runs into the end: the tokens since `start` repeat (a loop)
            period = [*draft] if next_token is None else [*draft, next_token]
            draft = [period[i % len(period)] for i in range(length)]
        return draft

    def record(self, drafted: int, accepted: int) -> None:
        """How a draft of `drafted` tokens (as verified: perhaps cut) fared: the acceptance estimate follows."""
        if drafted <= 0:
            return
        self._kept = ACCEPTANCE_DECAY * self._kept + accepted
        self._refused = ACCEPTANCE_DECAY * self._refused + (accepted < drafted)

    def _check_shadow(self, token: int) -> None:
        """The sequence went on with `token`: one more shadow token kept, or the shadow draft ends here."""
        if token == self._shadow[self._shadow_kept]:
            self._shadow_kept += 1
            if self._shadow_kept < len(self._shadow):
                return
        self.record(len(self._shadow), self._shadow_kept)
        self._shadow = []

    def _find(self, tokens: Sequence[int]) -> int | None:
        """Where the tokens after the longest indexed n-gram that ends `tokens` start, in the whole context."""
        for n in range(min(self._limits.max_ngram, len(tokens)), MIN_NGRAM - 1, -1):
            start = self._index[n - MIN_NGRAM].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return start
        return None
