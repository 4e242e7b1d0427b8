"""The summary's guard against degenerate output: the sampling of each pass, and what makes a pass worth a retry.

Greedy decoding on a small model can fall into a loop (SmolLM2-135M writes one line of an itinerary again and
again until `max_output_tokens`) or copy the transcript back instead of summarizing it. The first pass is plain
greedy, which copies names and numbers most faithfully; a pass that degenerates is retried once with a
repetition penalty (vLLM's and Hugging Face's: every token of the prompt and the output counts), which breaks the
loop at some cost in fidelity. Only the compactor's summary uses this: a user's request keeps its own sampling.

Repetition is measured as rep-n (Welleck et al., 2019): the share of the word n-grams in the text's tail that
repeat an earlier one there. A loop scores near 1, prose near 0; an itinerary's repeated shape ("Day 2: ... at
09:00.") stays well below the bar because its names and numbers differ.
"""

from __future__ import annotations

import re
from enum import Enum

from courier.engine.generation import FinishReason, SamplingParams

# The repetition penalty of each pass, in order: plain greedy, then one retry. Their number bounds the retries.
PASS_PENALTIES = (1.0, 1.1)
TAIL_CHARS = 4096  # the text looked at: enough for `TAIL_UNITS` units of any plausible text
TAIL_UNITS = 200  # words and punctuation marks: a loop shows once it has run about three times in them
NGRAM = 4
MAX_REPEATED_SHARE = 0.5  # rep-n above this is a loop
MIN_UNITS = 64  # below this a tail is too short to call a loop
CHECK_EVERY = 16  # a streaming summary is looked at once per this many pieces

_UNIT = re.compile(r"\w+|[^\w\s]")


class Verdict(Enum):
    """What one summary pass is worth. `LOOP` and `ECHO` are retried with the next pass's sampling."""

    USABLE = "usable"
    LOOP = "loop"  # its tail repeats itself
    ECHO = "echo"  # it ended, but is no shorter than the history it replaces (a transcript copied back)
    CUT = "cut"  # cut by max_output_tokens without a loop: a retry would be cut alike
    EMPTY = "empty"

    @property
    def degenerate(self) -> bool:
        return self in (Verdict.LOOP, Verdict.ECHO)


def pass_sampling(max_tokens: int, attempt: int) -> SamplingParams:
    """The sampling of summary pass `attempt` (0 first): greedy, with the pass's repetition penalty."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, repetition_penalty=PASS_PENALTIES[attempt])


def repeated_share(text: str) -> float:
    """rep-n of the tail of `text`: the share of its n-grams that occur earlier in the tail (0 with too few)."""
    units = _UNIT.findall(text[-TAIL_CHARS:])[-TAIL_UNITS:]
    if len(units) < MIN_UNITS:
        return 0.0
    grams = [tuple(units[index : index + NGRAM]) for index in range(len(units) - NGRAM + 1)]
    return 1 - len(set(grams)) / len(grams)


def looping(text: str) -> bool:
    """Whether the tail of `text` repeats itself: the same few phrases over and over."""
    return repeated_share(text) > MAX_REPEATED_SHARE


def verdict(text: str, reason: FinishReason, completion_tokens: int, history_tokens: int) -> Verdict:
    """What one finished pass is worth; `history_tokens`: what the summary replaces, which it must be shorter than."""
    if looping(text):
        return Verdict.LOOP
    if reason is FinishReason.LENGTH:
        return Verdict.CUT
    if completion_tokens >= history_tokens:
        return Verdict.ECHO
    return Verdict.USABLE if text.strip() else Verdict.EMPTY


class LoopWatch:
    """Reads a summary as it streams and says when its tail has become a loop, so the pass can stop early."""

    def __init__(self) -> None:
        self._tail = ""
        self._pieces = 0

    def add(self, text: str) -> bool:
        """Take the next piece; whether the text so far ends in a loop (looked at every `CHECK_EVERY` pieces)."""
        self._tail = (self._tail + text)[-TAIL_CHARS:]
        self._pieces += 1
        return self._pieces % CHECK_EVERY == 0 and looping(self._tail)
