"""The per-step prefill chunk: a budget's worth, whether or not streams decode; the whole step size with no budget."""

from __future__ import annotations

import pytest

from courier.core.step_planning.prefill_budget import MIN_CHUNK, PrefillBudget


def trained(stall_s: float, fixed: float, per_token: float, largest: int = 512) -> PrefillBudget:
    """A budget that has timed steps of several sizes on a machine of that cost line."""
    budget = PrefillBudget(stall_s=stall_s, largest=largest)
    for positions in (8, 8, 40, 72, 520, 520):
        budget.observe(positions=positions, seconds=fixed + per_token * positions)
    return budget


def test_with_nothing_to_prefill_a_step_takes_the_whole_step_size() -> None:
    assert trained(0.5, 0.1, 0.008).chunk(prefilling=0) == 512


@pytest.mark.parametrize(
    ("per_token", "prefilling", "expected"),
    [
        (0.008, 1, 62),  # a 2-core CPU: 0.5 s holds 62 tokens
        (0.008, 2, MIN_CHUNK),  # two prompts share them, but never under the smallest chunk
        (0.0001, 1, 512),  # a GPU: the whole step size fits the budget
        (0.001, 4, 125),
    ],
)
def test_a_step_prefills_what_fits_the_budget(per_token: float, prefilling: int, expected: int) -> None:
    assert trained(0.5, 0.1, per_token).chunk(prefilling=prefilling) == expected


def test_no_budget_means_the_whole_step_size() -> None:
    assert trained(0.0, 0.1, 0.008).chunk(prefilling=1) == 512


def test_an_untimed_budget_starts_from_the_prior_and_follows_the_steps() -> None:
    budget = PrefillBudget(stall_s=0.5, largest=512)
    first = budget.chunk(prefilling=1)
    assert MIN_CHUNK <= first < 512
    for positions in (8, 520, 8, 520):
        budget.observe(positions=positions, seconds=0.1 + 0.00005 * positions)  # a fast machine
    assert budget.chunk(prefilling=1) == 512
