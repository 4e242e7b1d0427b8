"""Figures from samples. One meaning per name: a percentile is a value at a rank, a share is a fraction of a whole
(shown as a percentage by `report.percent`), a ratio is one figure over another."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value at `fraction` (0.5: the median) by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def percentile_or_none(values: Sequence[float], fraction: float) -> float | None:
    return percentile(values, fraction) if values else None


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def finite_median(values: Sequence[float]) -> float:
    """The median of the finite values (NaN when there are none)."""
    finite = [value for value in values if math.isfinite(value)]
    return statistics.median(finite) if finite else math.nan


def share(part: float, whole: float) -> float | None:
    """`part` as a fraction of `whole` (None when the whole is 0)."""
    return part / whole if whole else None


def ratio(top: float | None, bottom: float | None) -> float | None:
    """`top` / `bottom`, None when either is missing or the bottom is 0."""
    return top / bottom if top is not None and bottom else None
