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

An n-gram is indexed by a 64-bit hash of its tokens. The context a sequence starts with is indexed with numpy, as
sorted keys searched by bisection: a prompt of 20K tokens takes ~10 ms on the MLX thread before its first token,
where a dict of token tuples took ~30 ms. What it generates goes into a dict, looked up first (the most recent
occurrence wins). Two n-grams hashing alike would only propose a draft the verify pass refuses.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_NGRAM = 2
# Acceptance is estimated from recent drafts (older ones weigh this much less per draft), from a prior of 1 in 2.
ACCEPTANCE_DECAY = 0.8
# An n-gram's key: k = k * KEY_MULTIPLIER + token + 1 over its tokens, modulo 2**64 (numpy's uint64 arithmetic).
KEY_MULTIPLIER = 0x9E3779B97F4A7C15
KEY_MASK = 2**64 - 1


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
        self._tokens: list[int] = list(context)
        lengths = range(MIN_NGRAM, limits.max_ngram + 1)
        # [n - MIN_NGRAM]: an n-gram's key -> where the tokens after its most recent occurrence start; in the
        # context the sequence started with, and since.
        self._context = SortedNgrams.of_context(self._tokens, limits.max_ngram)
        self._index: list[dict[int, int]] = [{} for _ in lengths]
        # [n]: the key of the context's last n tokens (n up to max_ngram, while there are that many), kept as the
        # context grows: each new token's keys follow from the last ones in one multiply-add each.
        self._last_keys = [ngram_key(self._tokens[len(self._tokens) - n :]) for n in range(limits.max_ngram + 1)]
        self._kept, self._refused = 1.0, 1.0  # decayed counts of draft tokens kept, and of drafts cut short
        self._shadow: list[int] = []  # a draft not verified, checked against the tokens that follow
        self._shadow_kept = 0

    @property
    def draft_length(self) -> int:
        """How many tokens a draft has (when it finds a match)."""
        return self._limits.max_draft

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept, given the ones before it were (recent drafts)."""
        return self._kept / (self._kept + self._refused)

    def extend(self, tokens: Iterable[int]) -> None:
        """The sequence went on with `tokens` (what it generated)."""
        for token in tokens:
            if self._shadow:
                self._check_shadow(token)
            end = len(self._tokens)  # the new token's position: it follows the n-grams that end just before it
            for n, index in enumerate(self._index, start=MIN_NGRAM):
                if end >= n:
                    index[self._last_keys[n]] = end
            self._tokens.append(token)
            self._last_keys = _keys_then(self._last_keys, token)

    def may_propose(self) -> bool:
        """Whether a draft is likely after the next token: the context as it stands has a match (cheap, no copy)."""
        return self._find(self._last_keys, len(self._tokens)) is not None

    def shadow(self) -> None:
        """Draft after the context as it stands without verifying it (unless a shadow draft is being checked):
        the tokens that follow are recorded against it as a verified draft's would be."""
        if not self._shadow:
            self._shadow, self._shadow_kept = self.propose(), 0

    def propose(self, next_token: int | None = None) -> list[int]:
        """`max_draft` tokens to follow the context (and `next_token`, not yet added), or none without a match."""
        self._shadow = []  # a draft to verify replaces any shadow one
        if next_token is None:
            start = self._find(self._last_keys, len(self._tokens))
        else:
            start = self._find(_keys_then(self._last_keys, next_token), len(self._tokens) + 1)
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

    def _find(self, last_keys: Sequence[int], length: int) -> int | None:
        """Where the tokens after the longest indexed n-gram that ends a context of `length` tokens start, in the
        whole context; `last_keys[n]` is the key of that context's last n tokens."""
        for n in range(min(self._limits.max_ngram, length), MIN_NGRAM - 1, -1):
            key = last_keys[n]
            start = self._index[n - MIN_NGRAM].get(key)
            if start is None:
                start = self._context[n - MIN_NGRAM].get(key)
            if start is not None:
                return start
        return None


def _keys_then(last_keys: Sequence[int], token: int) -> list[int]:
    """The keys of the last 0..len-1 tokens after `token` follows: each n-gram's is its (n-1)-gram's, then `token`."""
    step = token + 1
    return [0] + [(key * KEY_MULTIPLIER + step) & KEY_MASK for key in last_keys[:-1]]


def ngram_key(tokens: Sequence[int]) -> int:
    """The n-gram's key, as `SortedNgrams.of` computes it with numpy."""
    key = 0
    for token in tokens:
        key = (key * KEY_MULTIPLIER + token + 1) & KEY_MASK
    return key


@dataclass(frozen=True, slots=True)
class SortedNgrams:
    """A context's n-grams of one length: their distinct keys ascending, and where the tokens after each one's
    last occurrence start. Computed with numpy, kept as lists: a lookup is a `bisect`, a fraction of a microsecond
    (a numpy `searchsorted` from Python costs a few, and a decode step looks up to six times a sequence)."""

    keys: list[int]
    starts: list[int]

    @classmethod
    def of_context(cls, tokens: Sequence[int], max_ngram: int) -> list[SortedNgrams]:
        """The context's n-grams of each length from MIN_NGRAM to `max_ngram`: its tokens read into numpy once, and
        each length's keys from the one before (an n-gram's key is its (n-1)-gram's, then one token more)."""
        window = np.asarray(tokens[: max(len(tokens) - 1, 0)], dtype=np.uint64) + np.uint64(1)
        keys, indexes = window, []  # keys[j]: the key of the n-gram starting at position j (n = 1 here)
        for n in range(2, max_ngram + 1):
            count = max(len(tokens) - n, 0)  # the positions from n on each follow an n-gram
            keys = keys[:count] * np.uint64(KEY_MULTIPLIER) + window[n - 1 : n - 1 + count]
            if n >= MIN_NGRAM:
                indexes.append(cls._sorted(keys, n) if count > 0 else cls([], []))
        return indexes

    @classmethod
    def _sorted(cls, keys: np.ndarray[tuple[int], np.dtype[np.uint64]], n: int) -> SortedNgrams:
        """`keys[j]` is the n-gram ending just before position `j + n`: the distinct keys, each with the latest."""
        order = np.argsort(keys, kind="stable")  # equal keys stay in order: the last of a run is the latest
        keys, starts = keys[order], np.arange(n, n + len(keys), dtype=np.int64)[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        return cls(keys[last].tolist(), starts[last].tolist())

    def get(self, key: int) -> int | None:
        at = bisect_left(self.keys, key)
        if at < len(self.keys) and self.keys[at] == key:
            return self.starts[at]
        return None
