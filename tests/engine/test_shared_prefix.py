"""The in-batch shared-prefix planner: which requests admitted together prefill their common start once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest

from courier.engine.shared_prefix import Candidate, InFlight, SharedPrefix, limit_for, match_in_flight, plan

SYSTEM = tuple(range(100, 124))  # a 24-token system prompt, as the chat template's default one


def candidate(tokens: Sequence[int], *, start: int = 0, origin: Hashable = None, boundary: int = 0) -> Candidate:
    return Candidate(tokens=tokens, start=start, origin=origin, limit=limit_for(len(tokens), start, boundary))


def suffix(n: int, length: int = 12) -> tuple[int, ...]:
    return tuple(1000 * (n + 1) + i for i in range(length))


@pytest.mark.parametrize(
    ("prompt_length", "start", "boundary", "expected"),
    [
        (40, 0, 0, 39),  # all but the last token
        (40, 0, 37, 37),  # not past a pending history boundary
        (40, 37, 37, 39),  # the boundary is already behind the cached prefix
        (40, 0, 40, 39),  # a boundary at the very end is no boundary
        (1, 0, 0, 0),
    ],
)
def test_limit(prompt_length: int, start: int, boundary: int, expected: int) -> None:
    assert limit_for(prompt_length, start, boundary) == expected


def test_a_burst_with_the_same_system_prompt_shares_it() -> None:
    prompts = [SYSTEM + suffix(n) for n in range(8)]
    assert plan([candidate(p) for p in prompts]) == [SharedPrefix(members=tuple(range(8)), start=0, length=24)]


def test_the_shared_prefix_is_the_longest_common_one_within_the_limits() -> None:
    common = (*SYSTEM, 7, 7, 7)
    prompts = [common + suffix(n) for n in range(3)]
    assert plan([candidate(p) for p in prompts])[0].length == 27
    # A history boundary inside the common part caps it there.
    capped = [candidate(p, boundary=25 if n == 1 else 0) for n, p in enumerate(prompts)]
    assert plan(capped)[0].length == 25
    # Identical prompts share all but the last token.
    same = [candidate(common + suffix(0)) for _ in range(3)]
    assert plan(same)[0].length == len(common) + 11


def test_a_cap_on_new_tokens_shortens_the_shared_prefix() -> None:
    prompts = [SYSTEM + suffix(n) for n in range(4)]
    assert plan([candidate(p) for p in prompts], max_tokens=16)[0].length == 16
    cached = [candidate(SYSTEM + suffix(n), start=4, origin="entry") for n in range(4)]
    assert plan(cached, max_tokens=16)[0].length == 20
    assert plan([candidate(p) for p in prompts], max_tokens=4) == []  # below the minimum


def test_different_starts_do_not_mix() -> None:
    other = tuple(range(500, 524))
    prompts = [SYSTEM + suffix(0), other + suffix(1), SYSTEM + suffix(2), other + suffix(3), SYSTEM + suffix(4)]
    plans = plan([candidate(p) for p in prompts])
    assert plans == [
        SharedPrefix(members=(0, 2, 4), start=0, length=24),
        SharedPrefix(members=(1, 3), start=0, length=24),
    ]
    # Same tokens but different cached states (or one with none) are different starting points.
    cached = [candidate(SYSTEM + suffix(n), start=4, origin=("entry", n % 2)) for n in range(6)]
    assert sorted(p.members for p in plan(cached)) == [(0, 2, 4), (1, 3, 5)]
    assert all((p.start, p.length, p.shared_tokens) == (4, 24, 20) for p in plan(cached))


@pytest.mark.parametrize(
    ("members", "shared", "worth_it"),
    [
        (2, 16, False),  # saves 16 tokens of prefill, costs one more forward pass: worth about as much
        (2, 17, True),
        (3, 8, False),
        (3, 9, True),
        (8, 8, True),
        (8, 7, False),  # below the minimum
    ],
)
def test_sharing_must_save_more_than_it_costs(members: int, shared: int, worth_it: bool) -> None:
    common = tuple(range(shared))
    prompts = [common + suffix(n) for n in range(members)]
    assert bool(plan([candidate(p) for p in prompts])) is worth_it


def test_requests_with_too_little_left_never_share() -> None:
    short = [candidate(SYSTEM[:9]) for _ in range(8)]  # limit 8 tokens, the minimum: shared
    assert plan(short)[0].length == 8
    assert plan([candidate(SYSTEM[:8]) for _ in range(8)]) == []
    assert plan([candidate(()) for _ in range(4)]) == []


def test_a_request_starts_from_the_in_flight_state_covering_most_of_it() -> None:
    in_flight = [
        InFlight(origin=None, start=0, tokens=SYSTEM),
        InFlight(origin=None, start=0, tokens=(*SYSTEM, *suffix(0, 4))),
        InFlight(origin="entry", start=4, tokens=(*SYSTEM, *suffix(1, 4))),
        InFlight(origin=None, start=0, tokens=SYSTEM[:7]),  # too short to be worth it
    ]
    for trimmable in (False, True):
        assert match_in_flight(candidate(SYSTEM + suffix(0)), in_flight, trimmable=trimmable) == (1, 28)
        assert match_in_flight(
            candidate(SYSTEM + suffix(1), start=4, origin="entry"), in_flight, trimmable=trimmable
        ) == (2, 28)
        assert (
            match_in_flight(candidate(SYSTEM + suffix(1), start=4, origin="other"), in_flight, trimmable=trimmable)
            is None
        )
        assert match_in_flight(candidate(SYSTEM[:7] + suffix(0)), in_flight, trimmable=trimmable) is None
    # Only a dense state can be cut down to a shorter prefix: where the prompt stops agreeing, or at its limit.
    assert match_in_flight(candidate(SYSTEM + suffix(2)), in_flight, trimmable=False) == (0, 24)
    assert match_in_flight(candidate((*SYSTEM, *suffix(0, 2), 5, 5)), in_flight, trimmable=True) == (1, 26)
    assert match_in_flight(candidate((*SYSTEM, *suffix(0, 2), 5, 5)), in_flight, trimmable=False) == (0, 24)
    assert match_in_flight(candidate(SYSTEM + suffix(0), boundary=26), in_flight, trimmable=True) == (1, 26)
    assert match_in_flight(candidate(SYSTEM + suffix(0), boundary=26), in_flight, trimmable=False) == (0, 24)
