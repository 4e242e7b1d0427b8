"""The per-step prefill chunk: a budget's worth at the prompt's depth, whether or not streams decode; the whole step
size with no budget; a cost model fitted to the timed steps, from a prior until they vary."""

from __future__ import annotations

import random

import pytest

from courier.core.step_planning.depth_costs import (
    PRIOR_PER_ATTENDED_SHARE,
    CostModel,
    DepthCosts,
    FixedDepthCosts,
    StepWork,
)
from courier.core.step_planning.prefill_budget import MIN_CHUNK, PrefillBudget

# SmolLM2 on a 2-core CPU, about: 0.1 s a step, 8 ms a position, 3.7 us a pair of positions attended.
CPU = CostModel(0.1, 0.008, 3.7e-6)


def prompts(*depths: int) -> StepWork:
    return StepWork(prefill_depths=depths)


def timed_steps(model: CostModel, noise: float = 0.0, seed: int = 0) -> DepthCosts:
    """A fitted model that has timed varied steps on a machine of `model`: decode batches at several depths, and
    prompts prefilled in chunks of several sizes and depths, each time off by up to `noise` (a share)."""
    costs = DepthCosts()
    rng = random.Random(seed)
    works = [StepWork(decode_depths=[depth] * rows) for rows in (1, 2, 8) for depth in (10, 500, 3000, 6000)]
    steps = [(work, 0) for work in works]
    steps += [(prompts(depth), chunk) for chunk in (32, 64, 512) for depth in (0, 1000, 4000)]
    steps += [(StepWork(decode_depths=[200, 6000], prefill_depths=[30]), 48)]
    for work, chunk in steps * 2:
        seconds = model.estimate(work.positions(chunk), work.attended(chunk))
        costs.observe(work.positions(chunk), work.attended(chunk), seconds * (1 + rng.uniform(-noise, noise)))
    return costs


def test_with_nothing_to_prefill_a_step_takes_the_whole_step_size() -> None:
    budget = PrefillBudget(stall_s=0.5, largest=512, costs=FixedDepthCosts(0.1, 0.008))
    assert budget.chunk(StepWork(decode_depths=[100, 200])) == 512


@pytest.mark.parametrize(
    ("model", "depths", "expected"),
    [
        (CostModel(0.1, 0.008, 0.0), (0,), 62),  # a 2-core CPU with no cost of depth: 0.5 s holds 62 tokens
        (CostModel(0.1, 0.008, 0.0), (0, 0), MIN_CHUNK),  # two prompts share them, but never under the floor
        (CostModel(0.1, 0.0001, 0.0), (0,), 512),  # a GPU: the whole step size fits the budget
        (CostModel(0.1, 0.001, 0.0), (0, 0, 0, 0), 125),
        (CPU, (0,), 61),  # attending costs a little at the start
        (CPU, (6000,), MIN_CHUNK),  # and holds a chunk 6K deep to the floor
        (CostModel(0.1, 0.001, 1e-6), (2000,), 162),  # 0.003 k + 5e-7 k^2 <= 0.5
    ],
)
def test_a_step_prefills_what_fits_the_budget(model: CostModel, depths: tuple[int, ...], expected: int) -> None:
    costs = FixedDepthCosts(model.fixed, model.per_position, model.per_attended)
    assert PrefillBudget(stall_s=0.5, largest=512, costs=costs).chunk(prompts(*depths)) == expected


@pytest.mark.parametrize("model", [CPU, CostModel(0.05, 0.001, 1e-6), CostModel(0.2, 0.004, 2e-5)])
def test_a_chunk_deep_in_a_prompt_is_smaller_and_its_cost_fits_the_budget(model: CostModel) -> None:
    """The same budget buys fewer tokens 6,000 deep than at the start; each chunk is the largest whose cost at its
    depth fits (or the floor, when not even that does)."""
    budget = PrefillBudget(
        stall_s=0.5, largest=512, costs=FixedDepthCosts(model.fixed, model.per_position, model.per_attended)
    )
    shallow, deep = budget.chunk(prompts(0)), budget.chunk(prompts(6000))
    assert deep < shallow
    for depth, chunk in ((0, shallow), (6000, deep)):
        work = StepWork(decode_depths=[300, 40], prefill_depths=[depth])
        if chunk < 512:
            assert model.prefill_seconds(work, chunk + 1) > 0.5
        assert chunk == MIN_CHUNK or model.prefill_seconds(work, chunk) <= 0.5


def test_the_deepest_prompt_sizes_the_chunk_of_all_prefilled_beside_it() -> None:
    budget = PrefillBudget(stall_s=0.5, largest=512, costs=FixedDepthCosts(0.1, 0.001, 1e-6))
    alone, beside_a_deep_one = budget.chunk(prompts(0, 0)), budget.chunk(prompts(0, 4000))
    assert beside_a_deep_one < alone
    assert CostModel(0.1, 0.001, 1e-6).prefill_seconds(prompts(0, 4000), beside_a_deep_one) <= 0.5


def test_no_budget_means_the_whole_step_size() -> None:
    budget = PrefillBudget(stall_s=0.0, largest=512, costs=FixedDepthCosts(0.1, 0.008, 1e-5))
    assert budget.chunk(prompts(6000)) == 512


@pytest.mark.parametrize("model", [CPU, CostModel(0.02, 0.0001, 2e-8), CostModel(0.3, 0.01, 0.0)])
def test_the_fit_recovers_the_machine_from_its_timed_steps(model: CostModel) -> None:
    fitted = timed_steps(model).model()
    assert fitted.fixed == pytest.approx(model.fixed, rel=1e-3)
    assert fitted.per_position == pytest.approx(model.per_position, rel=1e-3)
    assert fitted.per_attended == pytest.approx(model.per_attended, rel=1e-3, abs=1e-12)


def test_a_noisy_machine_and_a_load_spike_still_give_a_close_fit() -> None:
    costs = timed_steps(CPU, noise=0.1, seed=3)
    for _ in range(3):  # a spike: one kind of step took ten times as long
        costs.observe(1, 6000.0, 10 * CPU.estimate(1, 6000))
    fitted = costs.model()
    assert fitted.per_position == pytest.approx(CPU.per_position, rel=0.25)
    assert fitted.per_attended == pytest.approx(CPU.per_attended, rel=0.25)


def test_no_coefficient_comes_out_negative() -> None:
    """Steps that cost less the more they process (noise on a busy machine) leave a coefficient at 0, not below."""
    costs = DepthCosts()
    for positions, attended, seconds in ((1, 100, 0.5), (40, 2000, 0.4), (8, 9000, 0.45), (64, 500, 0.3)):
        costs.observe(positions, attended, seconds)
    fitted = costs.model()
    assert min(fitted.fixed, fitted.per_position, fitted.per_attended) >= 0


def test_steps_all_at_the_start_of_their_prompts_take_the_cost_of_depth_from_the_prior() -> None:
    """Nothing tells the cost of depth apart from that of positions: a line in the positions, the prior share for
    depth."""
    costs = DepthCosts()
    for positions in (8, 8, 40, 72, 520, 520):
        costs.observe(positions, 0.0, 0.1 + 0.008 * positions)
    fitted = costs.model()
    assert fitted.fixed == pytest.approx(0.1)
    assert fitted.per_position == pytest.approx(0.008)
    assert fitted.per_attended == pytest.approx(0.008 * PRIOR_PER_ATTENDED_SHARE)
    assert PrefillBudget(stall_s=0.5, largest=512, costs=costs).chunk(prompts(0)) == 62  # 0.008 k + 1e-6 k^2 <= 0.5


def test_one_size_of_step_splits_its_cost_by_the_prior() -> None:
    costs = DepthCosts()
    for _ in range(5):
        costs.observe(8, 800.0, 0.5)
    fitted = costs.model()
    assert fitted.estimate(8, 800.0) == pytest.approx(0.5)
    assert 0 < fitted.per_attended < fitted.per_position < fitted.fixed


def test_an_untimed_budget_starts_from_the_prior_and_follows_the_steps() -> None:
    budget = PrefillBudget(stall_s=0.5, largest=512)
    first = budget.chunk(prompts(0))
    assert MIN_CHUNK <= first < 512
    for work, chunk in ((StepWork(decode_depths=[50] * 8), 0), (prompts(0), 512)) * 2:
        budget.observe(work, chunk=chunk, prompt_tokens=chunk, seconds=0.1 + 0.00005 * work.positions(chunk))
    assert budget.chunk(prompts(0)) == 512  # a fast machine


def test_the_latest_costs_are_the_last_fitted_and_read_without_fitting() -> None:
    """What the scheduler reads off the MLX thread (`BatchEngine.admission_seconds`): the prior until a fit, then the
    model fitted last, while steps timed since wait for the MLX thread's next fit."""
    budget = PrefillBudget(stall_s=0.5, largest=512)
    untimed = budget.latest_costs
    assert untimed == budget.costs  # the prior, fitted from no step
    fast = CostModel(0.01, 0.0001, 1e-8)
    for rows in (8, 4, 2, 1):  # decode steps: timed, fitted at the next step that prefills
        work = StepWork(decode_depths=[50] * rows)
        budget.observe(work, chunk=0, prompt_tokens=0, seconds=fast.estimate(rows, work.attended(0)))
    assert budget.latest_costs == untimed
    work = prompts(0)
    budget.observe(work, chunk=512, prompt_tokens=512, seconds=fast.estimate(512, work.attended(512)))
    fitted = budget.latest_costs  # a prefill step is fitted at once
    assert fitted == budget.costs != untimed
    assert budget.chunk(prompts(0), untimed) < budget.chunk(prompts(0), fitted) == 512
    pinned = FixedDepthCosts(0.1, 0.01)
    assert PrefillBudget(stall_s=0.5, largest=512, costs=pinned).latest_costs == pinned.model()
