"""Polling by the clock, not by a count: a count of polls runs out sooner the faster the machine answers them."""

from __future__ import annotations

import time
from collections.abc import Iterator

DEADLINE_S = 120.0


def attempts(deadline_s: float = DEADLINE_S) -> Iterator[int]:
    """Attempt numbers for up to `deadline_s` seconds (at least one); the caller raises with what it last saw."""
    end = time.monotonic() + deadline_s
    attempt = 0
    while attempt == 0 or time.monotonic() < end:
        yield attempt
        attempt += 1
