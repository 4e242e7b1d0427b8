"""Terminal progress for long start-up steps (conversion, loading, warm-up).

A step prints when it starts and when it ends with its duration; a step with a
known number of units also prints a bar that redraws in place on a terminal and
falls back to a line every tenth of the way when stderr is a pipe or a file.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_BAR_WIDTH = 30
_PIPE_REPORT_FRACTION = 0.1


class Step:
    """One long step; `advance()` moves its bar when it has a total."""

    def __init__(self, title: str, total: int | None, stream: TextIO) -> None:
        self._title = title
        self._total = total
        self._stream = stream
        self._done = 0
        self._interactive = stream.isatty()
        self._next_report = _PIPE_REPORT_FRACTION

    def advance(self, units: int = 1) -> None:
        if not self._total:
            return
        self._done = min(self._total, self._done + units)
        fraction = self._done / self._total
        if self._interactive:
            filled = int(fraction * _BAR_WIDTH)
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            self._stream.write(f"\r  [{bar}] {self._done}/{self._total}")
            self._stream.flush()
        elif fraction + 1e-9 >= self._next_report:
            self._stream.write(f"  {self._title}: {int(fraction * 100)}%\n")
            self._stream.flush()
            while self._next_report <= fraction + 1e-9:
                self._next_report += _PIPE_REPORT_FRACTION

    def finish_line(self) -> None:
        if self._interactive and self._total:
            self._stream.write("\n")


class Progress:
    """Reports long steps on a text stream (stderr by default)."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled

    @contextmanager
    def step(self, title: str, total: int | None = None) -> Iterator[Step]:
        stream = self._stream if self._enabled else io.StringIO()
        stream.write(f"courier: {title} ...\n")
        stream.flush()
        started = time.monotonic()
        step = Step(title, total, stream)
        try:
            yield step
        except BaseException:
            step.finish_line()
            stream.write(f"courier: {title} failed after {time.monotonic() - started:.1f} s\n")
            stream.flush()
            raise
        step.finish_line()
        stream.write(f"courier: {title} done in {time.monotonic() - started:.1f} s\n")
        stream.flush()
