"""What a step costs with its depth: seconds = fixed + per_position * positions + per_attended * attended pairs.

A step's forward pass costs a fixed part (dispatching the layers), a part per position it processes (the weights'
matrix products, the same for every token) and a part per pair of positions attended (a token at depth `d` attends
to `d` earlier ones). Deep in a long prompt the last part dominates on a CPU: a chunk of 50 tokens 6K deep in
SmolLM2 took 1.3-1.8 s where a step of 55 at the start takes about 0.55 s, fixed part included, and a decode step of
a batch holding a 6K-deep row took 0.8-1.0 s. `StepWork` says what a step processes; mlx-lm pads a batch's KV
cache to its deepest row, so every row of the decode batch attends as deep as the deepest, and every prompt of the
prefill batch as deep as the deepest being prefilled (`attended`).

`DepthCosts` fits the three coefficients to the steps the engine timed: least squares, none negative (the best fit
over the subsets of coefficients left free, which is the non-negative least squares optimum for three), to the
median time of each kind of step (keyed by its positions and its attended pairs rounded to `ATTENDED_STEP`), the
most recent kinds kept, then once more without the points it fits worst (a load spike). What the timed steps cannot
tell apart comes from a prior: with no step timed, a fixed second and `PRIOR_PER_POSITION_SHARE` of it per
position; while the attended pairs do not vary apart from the positions (every step near the start of its prompt),
an attended pair costs `PRIOR_PER_ATTENDED_SHARE` of a position.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from courier.core.step_planning.recent_timings import LEAST_FIXED_S, RecentTimings, non_negative_line
from courier.core.step_planning.verify_width import PRIOR_PER_POSITION_SHARE

# Until the attended pairs vary apart from the positions: an attended pair's cost relative to a position's. SmolLM2
# on a 2-core CPU measured about 1/2,000 (a token 2,000 deep costs twice one at the start); larger models less.
PRIOR_PER_ATTENDED_SHARE = 1 / 4096
# Kinds of step kept (the least recently timed kind goes first), timings kept per kind, and how finely the attended
# pairs tell kinds apart (a ratio: kinds 5% apart are one).
MAX_KINDS = 256
RECENT_PER_KIND = 8
ATTENDED_STEP = 1.05
# Points left out of the second fit: those off by more than this many times the median misfit (when there are at
# least `ROBUST_MIN_POINTS`).
OUTLIER_MISFITS = 4.0
ROBUST_MIN_POINTS = 8
# How far the attended pairs must vary apart from the positions (the share of their spread a line in the positions
# leaves unexplained) before they are fitted rather than taken from the prior.
MIN_OWN_SPREAD = 0.01
# Columns (scaled to unit size) whose least singular value squared is this small against the largest are (nearly)
# collinear: one column the others make.
SINGULAR = 1e-9


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a step processes: one token of each decoding row, and `chunk` tokens of each prompt being prefilled."""

    decode_depths: Sequence[int] = ()  # each decoding row's depth (the positions its state holds)
    prefill_depths: Sequence[int] = ()  # each prompt's depth before this step's chunk

    def positions(self, chunk: int) -> int:
        return len(self.decode_depths) + chunk * len(self.prefill_depths)

    def attended(self, chunk: int) -> float:
        """Pairs of positions attended: each row of a batch as deep as the batch's deepest row."""
        decode = len(self.decode_depths) * max(self.decode_depths, default=0)
        deepest = max(self.prefill_depths, default=0)
        return decode + len(self.prefill_depths) * chunk * (deepest + chunk / 2)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds for a step: `fixed + per_position * positions + per_attended * attended`."""

    fixed: float
    per_position: float
    per_attended: float

    def estimate(self, positions: float, attended: float) -> float:
        return self.fixed + self.per_position * positions + self.per_attended * attended

    def prefill_seconds(self, work: StepWork, chunk: int) -> float:
        """What `chunk` tokens of each prompt being prefilled add to the step."""
        decode_only = StepWork(decode_depths=work.decode_depths)
        added_positions = work.positions(chunk) - decode_only.positions(0)
        added_attended = work.attended(chunk) - decode_only.attended(0)
        return self.per_position * added_positions + self.per_attended * added_attended


def prior(mean_seconds: float = 1.0, mean_positions: float = 0.0, mean_attended: float = 0.0) -> CostModel:
    """A step of the mean size costs the mean seconds, split by the prior shares."""
    share = PRIOR_PER_POSITION_SHARE
    fixed = mean_seconds / (1 + share * (mean_positions + PRIOR_PER_ATTENDED_SHARE * mean_attended))
    per_position = fixed * share
    return CostModel(fixed, per_position, per_position * PRIOR_PER_ATTENDED_SHARE)


@dataclass(frozen=True, slots=True)
class _Point:
    positions: float
    attended: float
    seconds: float


class DepthCosts:
    """The cost model fitted to the timed steps (see the module docstring)."""

    def __init__(self) -> None:
        self._kinds: RecentTimings[tuple[int, int], tuple[float, float]] = RecentTimings(
            kinds=MAX_KINDS, per_kind=RECENT_PER_KIND
        )
        self._model: CostModel | None = None
        self._latest: CostModel = prior()  # the last model fitted, kept while a newer step makes `_model` stale

    def observe(self, positions: int, attended: float, seconds: float) -> None:
        if positions <= 0 or seconds <= 0 or attended < 0:
            return
        self._kinds.add((positions, round(math.log(attended + 1, ATTENDED_STEP))), (attended, seconds))
        self._model = None

    def model(self) -> CostModel:
        if self._model is None:
            self._model = self._latest = self._fit()
        return self._model

    def latest(self) -> CostModel:
        """The model fitted last (the prior before any): never fitted here, so another thread may read it while the
        MLX thread times steps. It lags `model()` by the steps timed since."""
        return self._latest

    def _fit(self) -> CostModel:
        points = [
            _Point(positions, statistics.fmean(a for a, _ in timings), statistics.median(s for _, s in timings))
            for (positions, _), timings in self._kinds.items()
        ]
        model = fit(points)
        if len(points) < ROBUST_MIN_POINTS:
            return model
        misfits = [abs(point.seconds - model.estimate(point.positions, point.attended)) for point in points]
        cutoff = OUTLIER_MISFITS * statistics.median(misfits)
        kept = [point for point, misfit in zip(points, misfits, strict=True) if misfit <= cutoff]
        return fit(kept) if cutoff > 0 and len(kept) < len(points) else model


class FixedDepthCosts(DepthCosts):
    """A cost model given, not fitted (`observe` is ignored): for tests and for pinning a machine's measured one."""

    def __init__(self, fixed: float, per_position: float, per_attended: float = 0.0) -> None:
        super().__init__()
        self._fixed = CostModel(fixed, per_position, per_attended)

    def observe(self, positions: int, attended: float, seconds: float) -> None:
        del positions, attended, seconds

    def model(self) -> CostModel:
        return self._fixed

    def latest(self) -> CostModel:
        return self._fixed


def fit(points: Sequence[_Point]) -> CostModel:
    """Non-negative least squares of seconds on (1, positions, attended), with the prior for what does not vary."""
    if not points:
        return prior()
    count = len(points)
    mean_x = statistics.fmean(point.positions for point in points)
    mean_z = statistics.fmean(point.attended for point in points)
    mean_y = statistics.fmean(point.seconds for point in points)
    spread_x = sum((point.positions - mean_x) ** 2 for point in points)
    if count < 2 or spread_x == 0:  # one size only: split its cost by the prior
        return prior(mean_y, mean_x, mean_z)
    if _own_spread(points, mean_x, mean_z, spread_x) < MIN_OWN_SPREAD:
        # Depth does not vary apart from the positions: fit a line in positions + the prior share of attended.
        share = PRIOR_PER_ATTENDED_SHARE
        fixed, per_position = non_negative_line([(p.positions + share * p.attended, p.seconds) for p in points])
        return CostModel(fixed, per_position, per_position * share)
    return _non_negative(points)


def _own_spread(points: Sequence[_Point], mean_x: float, mean_z: float, spread_x: float) -> float:
    """The share of the attended pairs' spread that a line in the positions leaves unexplained."""
    spread_z = sum((point.attended - mean_z) ** 2 for point in points)
    if spread_z == 0:
        return 0.0
    covariance = sum((point.positions - mean_x) * (point.attended - mean_z) for point in points)
    return 1 - covariance**2 / (spread_x * spread_z)


def _non_negative(points: Sequence[_Point]) -> CostModel:
    """The best least-squares fit with no negative coefficient: of the fits with some coefficients held at 0 and the
    rest free, the one with the least squared misfit among those whose free coefficients come out non-negative.
    numpy does the algebra: this runs on every step that prefills, over up to `MAX_KINDS` points (5 ms in Python)."""
    columns = np.array([[1.0, point.positions, point.attended] for point in points])
    seconds = np.array([point.seconds for point in points])
    best: tuple[float, np.ndarray] | None = None
    for size in (3, 2, 1):
        for free in itertools.combinations(range(3), size):
            solved = _least_squares(columns[:, list(free)], seconds)
            if solved is None or solved.min() < 0:
                continue
            coefficients = np.zeros(3)
            coefficients[list(free)] = solved
            misfit = float(np.sum((seconds - columns @ coefficients) ** 2))
            if best is None or misfit < best[0]:
                best = (misfit, coefficients)
    if best is None:
        return prior(statistics.fmean(point.seconds for point in points))
    fixed, per_position, per_attended = (float(value) for value in best[1])
    return CostModel(max(fixed, LEAST_FIXED_S), per_position, per_attended)


def _least_squares(columns: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares with the columns scaled to unit size first; None when they are (nearly) collinear."""
    scales = np.abs(columns).max(axis=0)
    scales[scales == 0] = 1.0
    solution, _, rank, singular_values = np.linalg.lstsq(columns / scales, y, rcond=None)
    if rank < columns.shape[1] or singular_values.min() ** 2 < SINGULAR * max(1.0, singular_values.max() ** 2):
        return None
    scaled: np.ndarray = solution / scales
    return scaled
