"""Text-level stop sequences for a stream of decoded text.

Stop strings are matched on text, not token ids: the same string tokenizes
differently depending on what precedes it. Text that might still become the
start of a stop string is held back until it cannot, so no client ever sees a
partial stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopScan:
    """`text` may be emitted now; `stopped` says a stop string was reached (and is not in `text`)."""

    text: str
    stopped: bool


class StopTextMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""

    def feed(self, text: str) -> StopScan:
        if not self._stops:
            return StopScan(text, False)
        buffer = self._held + text
        first = min((index for stop in self._stops if (index := buffer.find(stop)) >= 0), default=-1)
        if first >= 0:
            self._held = ""
            return StopScan(buffer[:first], True)
        keep = held_back_length(buffer, self._stops)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopScan(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """Text held back when the stream ends without a stop string."""
        held, self._held = self._held, ""
        return held


def held_back_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = max((len(marker) for marker in markers), default=0)
    for length in range(min(len(text), longest - 1), 0, -1):
        suffix = text[-length:]
        if any(marker.startswith(suffix) for marker in markers):
            return length
    return 0
