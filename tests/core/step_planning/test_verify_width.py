"""The verify width: a cost line fitted to timed passes, and the width with the most expected tokens per second."""

from __future__ import annotations

import pytest

from courier.core.step_planning.verify_width import FixedCosts, RowDraft, StepCosts, best_width, expected_tokens


def costs(fixed: float, per_position: float, sizes: tuple[int, ...] = (1, 4, 8, 16, 32)) -> StepCosts:
    timed = StepCosts()
    for positions in sizes:
        timed.observe(positions, fixed + per_position * positions)
    return timed


def test_the_cost_line_is_fitted_to_timed_passes() -> None:
    fixed, per_position = costs(0.060, 0.004).line()
    assert fixed == pytest.approx(0.060) and per_position == pytest.approx(0.004)


def test_passes_of_one_size_split_their_cost_by_the_prior() -> None:
    fixed, per_position = costs(0.1, 0.0, sizes=(8, 8, 8)).line()
    assert fixed + 8 * per_position == pytest.approx(0.1) and per_position > 0


@pytest.mark.parametrize(
    ("draft", "width", "expected"),
    [
        (RowDraft(0, 0.9), 5, 1.0),
        (RowDraft(4, 1.0), 5, 5.0),
        (RowDraft(4, 1.0), 3, 3.0),  # cut to the width
        (RowDraft(2, 0.5), 9, 1.75),  # 1 + 0.5 + 0.25
        (RowDraft(3, 0.0), 4, 1.0),
    ],
)
def test_expected_tokens(draft: RowDraft, width: int, expected: float) -> None:
    assert expected_tokens(draft, width) == pytest.approx(expected)


def test_a_lone_stream_on_a_dispatch_bound_machine_verifies_its_whole_draft() -> None:
    assert best_width([RowDraft(8, 0.8)], costs(0.060, 0.004), most=9) >= 7


def test_a_full_batch_where_columns_cost_verifies_narrow_blocks_or_none() -> None:
    timed = costs(0.060, 0.004)
    copying = [RowDraft(8, 0.9)] * 8
    chatting = [RowDraft(3, 0.3)] + [RowDraft(0, 0.0)] * 7
    width = best_width(copying, timed, most=9)
    assert 2 <= width < 9
    assert best_width(chatting, timed, most=4) == 1


def test_with_nothing_timed_yet_a_likely_draft_is_tried() -> None:
    assert best_width([RowDraft(4, 0.5)], StepCosts(), most=5) > 1


def test_a_run_of_plain_steps_does_not_push_wider_passes_out_of_the_fit() -> None:
    timed = costs(0.060, 0.004, sizes=(8, 16, 24, 32))
    for _ in range(1000):
        timed.observe(8, 0.060 + 0.004 * 8 + 0.001)  # noisy plain steps, all of one size
    fixed, per_position = timed.line()
    assert per_position == pytest.approx(0.004, rel=0.1) and fixed == pytest.approx(0.060, rel=0.1)


def test_a_verify_must_beat_a_plain_step_by_a_margin() -> None:
    # A pass of two positions costs 1.10 / 1.05 of one: 1.1 expected tokens is not enough gain, 1.9 is.
    line = FixedCosts(1.0, 0.05)
    assert best_width([RowDraft(1, 0.1)], line, most=2) == 1
    assert best_width([RowDraft(1, 0.9)], line, most=2) == 2
