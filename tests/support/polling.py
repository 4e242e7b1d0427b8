"""Polling by the clock, not by a count: a count of polls runs out sooner the faster the machine answers them."""

from __future__ import annotations

import time
from collections.abc import Iterator

DEADLINE_S = 120.0
# The pause between attempts doubles from the first to the most: a condition that holds at once costs nothing, and
# a poll of a server that is still working (snapshot writes, warm-ups) does not take the core that work needs.
FIRST_PAUSE_S = 0.002
MOST_PAUSE_S = 0.05


def attempts(deadline_s: float = DEADLINE_S) -> Iterator[int]:
    """Attempt numbers for up to `deadline_s` seconds (at least one); the caller raises with what it last saw. The
    first attempt comes at once, each later one after a pause that grows to MOST_PAUSE_S."""
    end = time.monotonic() + deadline_s
    attempt = 0
    pause = FIRST_PAUSE_S
    while attempt == 0 or time.monotonic() < end:
        if attempt:
            time.sleep(pause)
            pause = min(pause * 2, MOST_PAUSE_S)
        yield attempt
        attempt += 1
