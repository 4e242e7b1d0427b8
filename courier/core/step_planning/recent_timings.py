"""What the step cost models are fitted to: the most recent timings of each kind of step, and the line they share.

A kind of step is what a model tells steps apart by (a pass size; a size and a depth). Each kind keeps its last
few timings, so a run of steps of one kind does not push the others out of the fit; the least recently timed kind
goes first once there are too many.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, ItemsView, Sequence
from typing import Generic, TypeVar

Kind = TypeVar("Kind", bound=Hashable)
Timing = TypeVar("Timing")

# A step is never free: the least intercept a fitted line gets.
LEAST_FIXED_S = 1e-6


class RecentTimings(Generic[Kind, Timing]):
    def __init__(self, *, kinds: int, per_kind: int) -> None:
        self._kinds: OrderedDict[Kind, deque[Timing]] = OrderedDict()
        self._most_kinds = kinds
        self._per_kind = per_kind

    def add(self, kind: Kind, timing: Timing) -> None:
        timings = self._kinds.get(kind)
        if timings is None:
            timings = self._kinds[kind] = deque(maxlen=self._per_kind)
            if len(self._kinds) > self._most_kinds:
                self._kinds.popitem(last=False)
        self._kinds.move_to_end(kind)
        timings.append(timing)

    def items(self) -> ItemsView[Kind, deque[Timing]]:
        return self._kinds.items()

    def __bool__(self) -> bool:
        return bool(self._kinds)


def non_negative_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line, both at least 0 (the intercept at least `LEAST_FIXED_S`)."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 0.0) if spread > 0 else 0.0
    return max(mean_y - slope * mean_x, LEAST_FIXED_S), slope
