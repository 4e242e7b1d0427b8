"""How wide a verify pass should be: the width that gives the most expected tokens per second.

A forward pass over `positions` tokens (rows x block width) costs about `fixed + per_position * positions` seconds:
at batch 1 on a CPU the fixed part (dispatching 30 layers) dominates and a block of 9 costs 1.5 times a block of
1, while at batch 8 every extra column costs a third of a step. `StepCosts` fits that line to the passes the
engine timed (least squares over the most recent ones), so the choice follows the machine and the model, not
constants. Timings are kept per pass size (the most recent few of each), and the line is fitted to each size's
median: a run of plain steps, all of one size, does not push the sizes verify passes had out of the fit (a fit to
the last passes alone would then guess the cost of a wider pass from noise, and might never try one again).

`best_width` then weighs each width: a row with a draft of `d` tokens, each kept with probability `p` (its recent
acceptance), is expected to emit `1 + p + p^2 + ... + p^min(d, width - 1)` tokens; rows without a draft emit one.
A wider pass must beat a plain one by `MIN_VERIFY_GAIN`: a plain step overlaps its host work with the next pass,
a verify pass does not. A width of 1 means no verify pass pays: the plain, pipelined step runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from courier.core.step_planning.recent_timings import RecentTimings, non_negative_line

# Timings kept per pass size, and pass sizes kept (the least recently timed size goes first).
RECENT_PER_SIZE = 16
MAX_SIZES = 256
# How many times the tokens per second of a plain step a verify pass must be expected to reach.
MIN_VERIFY_GAIN = 1.1
# Until passes of more than one size have been timed: the cost of a column relative to a step's fixed cost.
PRIOR_PER_POSITION_SHARE = 0.05


@dataclass(frozen=True, slots=True)
class RowDraft:
    tokens: int  # draft length (0: the row rides along with its one token)
    acceptance: float  # the chance each draft token is kept (1.0 for tokens a grammar forces)


class StepCosts:
    """Seconds per forward pass as a line in its positions, fitted to the median recent time of each pass size."""

    def __init__(self) -> None:
        self._sizes: RecentTimings[int, float] = RecentTimings(kinds=MAX_SIZES, per_kind=RECENT_PER_SIZE)
        self._line: tuple[float, float] | None = None

    def observe(self, positions: int, seconds: float) -> None:
        if positions <= 0 or seconds <= 0:
            return
        self._sizes.add(positions, seconds)
        self._line = None

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per position); a prior share per position until sizes vary."""
        if self._line is None:
            self._line = self._fit()
        return self._line

    def _fit(self) -> tuple[float, float]:
        if not self._sizes:
            return 1.0, PRIOR_PER_POSITION_SHARE
        points = [(float(x), statistics.median(timings)) for x, timings in self._sizes.items()]
        if len(points) == 1:  # one size only: split its cost by the prior
            ((size, seconds),) = points
            fixed = seconds / (1 + PRIOR_PER_POSITION_SHARE * size)
            return fixed, fixed * PRIOR_PER_POSITION_SHARE
        return non_negative_line(points)

    def estimate(self, positions: int) -> float:
        fixed, per_position = self.line()
        return fixed + per_position * positions


def expected_tokens(draft: RowDraft, width: int) -> float:
    """Tokens a row is expected to emit from a pass `width` wide: its input's next token, plus kept drafts."""
    used = min(draft.tokens, width - 1)
    p = min(max(draft.acceptance, 0.0), 1.0)
    if p >= 1.0:
        return 1.0 + used
    return (1 - p ** (used + 1)) / (1 - p)


def best_width(drafts: Sequence[RowDraft], costs: StepCosts, most: int) -> int:
    """The block width (1 .. most) with the most expected tokens per second of forward pass (a width above 1 only
    when it beats a plain step by `MIN_VERIFY_GAIN`)."""
    rows = len(drafts)
    longest = max((draft.tokens for draft in drafts), default=0)
    best, best_rate = 1, MIN_VERIFY_GAIN * rows / costs.estimate(rows)
    for width in range(2, min(most, longest + 1) + 1):
        rate = sum(expected_tokens(draft, width) for draft in drafts) / costs.estimate(rows * width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class FixedCosts(StepCosts):
    """A cost line given, not fitted (`observe` is ignored): for tests and for pinning a machine's measured line."""

    def __init__(self, fixed: float, per_position: float) -> None:
        super().__init__()
        self._fixed = (fixed, per_position)

    def observe(self, positions: int, seconds: float) -> None:
        del positions, seconds

    def line(self) -> tuple[float, float]:
        return self._fixed
