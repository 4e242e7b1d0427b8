"""Prompt-lookup drafts: what they propose, and how the draft length and the acceptance estimate adapt."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from courier.core.step_planning.prompt_lookup import LookupLimits, PromptLookup

LIMITS = LookupLimits(max_ngram=3, max_draft=4)


@pytest.mark.parametrize(
    ("context", "next_token", "draft"),
    [
        ([1, 2, 3, 4, 5, 1, 2], None, [3, 4, 5, 1]),  # "1 2" seen before: what followed it
        ([1, 2, 3, 4, 5, 1], 2, [3, 4, 5, 1]),  # the same, with the next token not yet added
        ([1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3], None, [9, 7, 2, 3]),  # the longest n-gram wins: "1 2 3", not "2 3"
        ([5, 6, 7, 8, 6, 7], None, [8, 6, 7, 8]),  # one that runs to the end of the context repeats (a loop)
        ([1, 2, 3, 4], None, []),  # nothing repeats
        ([1, 2, 3, 4, 2], None, []),  # one token is not an n-gram
        ([4, 4, 4, 4], 4, [4, 4, 4, 4]),
        ([7, 1, 2, 3, 1, 2], 3, [1, 2, 3, 1]),
    ],
)
def test_a_draft_is_what_followed_the_last_tokens_before(
    context: list[int], next_token: int | None, draft: list[int]
) -> None:
    assert PromptLookup(context, LIMITS).propose(next_token) == draft


def test_the_most_recent_occurrence_is_the_one_followed() -> None:
    lookup = PromptLookup([1, 2, 10, 1, 2, 20, 1, 2], LIMITS)
    assert lookup.propose()[:1] == [20]


def test_a_draft_has_the_whole_length_however_the_last_ones_fared() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], LookupLimits(max_ngram=3, max_draft=8))
    assert len(lookup.propose()) == 8
    lookup.record(drafted=8, accepted=0)  # the engine decides how much of it to verify
    assert len(lookup.propose()) == 8 == lookup.draft_length


def test_drafts_that_miss_lower_the_acceptance_and_drafts_that_land_raise_it() -> None:
    lookup = PromptLookup([1, 2, 3, 1, 2], LIMITS)
    prior = lookup.acceptance
    for _ in range(3):
        lookup.record(drafted=3, accepted=0)
    missing = lookup.acceptance
    assert missing < prior / 2
    for _ in range(3):
        lookup.record(drafted=2, accepted=2)
    assert lookup.acceptance > missing


def test_a_shadow_draft_is_judged_by_the_tokens_that_follow() -> None:
    copying = PromptLookup([1, 2, 3, 4, 5, 6, 1, 2], LIMITS)
    copying.shadow()  # drafts [3, 4, 5, 6] without a verify
    copying.extend([3, 4, 5, 6])
    chatting = PromptLookup([1, 2, 3, 4, 5, 6, 1, 2], LIMITS)
    chatting.shadow()
    chatting.extend([7])  # the first shadow token missed
    assert copying.acceptance > 0.5 > chatting.acceptance


def test_a_shadow_draft_waits_for_its_tokens_and_a_draft_to_verify_replaces_it() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 6, 1, 2], LIMITS)
    lookup.shadow()
    lookup.extend([3, 4])
    before = lookup.acceptance
    lookup.shadow()  # one is being checked: no new one
    assert lookup.acceptance == before
    lookup.propose()  # a real draft: the shadow is dropped, nothing recorded for it
    lookup.extend([9])
    assert lookup.acceptance == before


@pytest.mark.parametrize(("ngram", "draft"), [(1, 4), (3, 0)])
def test_limits_are_checked(ngram: int, draft: int) -> None:
    with pytest.raises(ValueError, match="must be at least"):
        LookupLimits(max_ngram=ngram, max_draft=draft)


@given(
    st.lists(st.integers(0, 5), max_size=60),
    st.lists(st.integers(0, 5), max_size=20),
    st.one_of(st.none(), st.integers(0, 5)),
)
def test_a_draft_always_continues_an_earlier_occurrence_of_the_last_tokens(
    prompt: list[int], more: list[int], next_token: int | None
) -> None:
    lookup = PromptLookup(prompt, LIMITS)
    lookup.extend(more)
    context = prompt + more
    tail = context + ([] if next_token is None else [next_token])
    draft = lookup.propose(next_token)
    assert len(draft) <= LIMITS.max_draft
    if not draft:
        return

    # Some n-gram (n >= 2) ending the tail occurs earlier in the context, followed by the draft (which repeats
    # the tokens from there on when it runs into the end of the tail).
    def follows(start: int) -> bool:
        period = len(tail) - start
        return all(draft[i] == (tail[start + i] if i < period else draft[i - period]) for i in range(len(draft)))

    assert any(
        context[start - n : start] == tail[len(tail) - n :] and follows(start)
        for n in range(2, LIMITS.max_ngram + 1)
        for start in range(n, len(context))
        if len(tail) >= n
    )


@given(
    tokens=st.lists(st.integers(0, 3), max_size=120),
    cut=st.integers(0, 120),
    more=st.lists(st.integers(0, 3), max_size=12),
)
def test_a_context_indexed_at_once_drafts_as_one_fed_token_by_token(
    tokens: list[int], cut: int, more: list[int]
) -> None:
    """The context a lookup starts with is indexed as sorted arrays, what follows in a dict: wherever the split
    falls, the drafts are those of a lookup fed every token one at a time."""
    limits = LookupLimits(max_ngram=4, max_draft=5)
    one_by_one = PromptLookup([], limits)
    for token in tokens:
        one_by_one.extend([token])
    at_once = PromptLookup(tokens, limits)
    split = PromptLookup(tokens[:cut], limits)
    split.extend(tokens[cut:])
    for token in more:
        assert one_by_one.propose() == at_once.propose() == split.propose()
        assert one_by_one.propose(token) == at_once.propose(token) == split.propose(token)
        for lookup in (one_by_one, at_once, split):
            lookup.extend([token])
