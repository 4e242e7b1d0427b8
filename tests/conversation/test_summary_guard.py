"""The summary guard: what counts as a loop, each pass's verdict, the sampling of each pass, the streaming watch.

The loops are SmolLM2-135M's own, from greedy summaries of itinerary histories (`tests/test_compaction_real_model.py`
has the histories); the usable texts include summaries with an itinerary's repeated shape, which must not count.
"""

from __future__ import annotations

import pytest

from courier.conversation.summary_guard import (
    CHECK_EVERY,
    MAX_REPEATED_SHARE,
    MIN_UNITS,
    PASS_PENALTIES,
    LoopWatch,
    Verdict,
    looping,
    pass_sampling,
    repeated_share,
    verdict,
)
from courier.engine.generation import FinishReason, SamplingParams

ROME_LOOP = (
    "User: I'm going to Rome, 3-10 June. I'll take a flight to Airbnb in Trastevere.\n\n"
    "Assistant: Good job! You're going to Rome, 3-10 June. You'll take a flight to Airbnb in Trastevere.\n\n"
    + "User: Hotel: Albergo del Senato, 4 nights, confirmation 77821. Then Airbnb in Trastevere.\n\n"
    "Assistant: Good job! You're going to Rome, 3-10 June. You'll take a flight to Airbnb in Trastevere.\n\n" * 6
)
# Not one verbatim line: the day number goes up on each.
LISBON_LOOP = (
    "Day 1: Land 10:20, taxi to Alfama.\n\nDay 2: Belem 09:00, pasteis at 11:00, MAAT museum 14:00.\n\n"
    + "".join(f"Day {day}: Belem 14:00, pasteis at 14:00, MAAT museum 14:00.\n\n" for day in range(3, 16))
)
CONFERENCE_LOOP = "15 May: talk 'Async in practice' 11:00 room 3, lunch 12:30.\n\n" + (
    "User: 15 May: talk 'Async in practice' 11:00 room 3, lunch 12:30.\n\n" * 12
)
PUNCTUATION_LOOP = "The plan is set" + "!" * 300
LOOPS = [ROME_LOOP, LISBON_LOOP, CONFERENCE_LOOP, PUNCTUATION_LOOP]

ITINERARY = (
    "Day 1: arrive Kyoto 14:05 on Nozomi 21, Hotel Granvia room 812. Day 2: Fushimi Inari 07:00, Tofuku-ji 10:30, "
    "lunch at Kyoto Station. Day 3: Arashiyama bamboo grove 08:00, Tenryu-ji 09:30, boat 13:00. Day 4: Kinkaku-ji "
    "09:00, Ryoan-ji 11:00, tea ceremony 15:00, booking K-4471. Day 5: Nara, train 08:12, Todai-ji 10:00, deer park. "
    "Day 6: Gion 18:00, Gion Karyo 19:30 for 2. Day 7: Nishiki 10:00, shopping, pack, 42,000 yen left. Day 8: "
    "checkout 10:00, Haruka 11:16, JL 61 at 17:05."
)
WEEK = (
    "Monday: standup 09:00, Priya 11:00, dentist 15:30. Tuesday: gym 07:00, budget review 10:00, kids 16:00. "
    "Wednesday: standup 09:00, design review 13:00, dinner Sam 19:00. Thursday: gym 07:00, Marco 14:00, car service "
    "17:00. Friday: standup 09:00, release v2.3 12:00, drinks 18:00. Saturday: market 09:00, football 11:00, movie "
    "20:00. Sunday: brunch 11:00, laundry, prep week."
)
PROSE = (
    "Ada Lovelace is planning a trip to Lisbon in May with her dog Biscuit. She needs a hotel that accepts dogs near "
    "the Alfama district, under 150 euros a night, and her flight TP1234 leaves at 09:40. Small guesthouses in Alfama "
    "were suggested; she should check each one's pet policy and nightly price before booking."
)
USABLE = [ITINERARY, WEEK, PROSE]


@pytest.mark.parametrize("text", LOOPS, ids=["rome", "lisbon-counting-days", "conference", "punctuation"])
def test_a_loop_is_seen_in_the_tail(text: str) -> None:
    assert repeated_share(text) > MAX_REPEATED_SHARE
    assert looping(text)
    assert looping(PROSE + "\n\n" + text)  # only the tail counts: a good start does not hide a loop


@pytest.mark.parametrize("text", USABLE, ids=["itinerary", "week-of-notes", "prose"])
def test_a_summary_with_a_repeated_shape_is_no_loop(text: str) -> None:
    assert repeated_share(text) < MAX_REPEATED_SHARE / 2
    assert not looping(text)


def test_a_tail_too_short_to_tell_is_no_loop() -> None:
    line = "Day 4: Belem 14:00. "  # 8 words and marks
    assert MIN_UNITS // 8 == 8
    assert not looping(line * 7)  # 56: too few to tell
    assert looping(line * 8)
    assert not looping("")


HISTORY_TOKENS = 200
VERDICTS = [
    (PROSE, FinishReason.STOP, 60, Verdict.USABLE),
    (PROSE, FinishReason.STOP, 199, Verdict.USABLE),
    (PROSE, FinishReason.STOP, 200, Verdict.ECHO),  # no shorter than the history it replaces
    (LISBON_LOOP, FinishReason.LENGTH, 300, Verdict.LOOP),
    (LISBON_LOOP, FinishReason.STOP, 180, Verdict.LOOP),  # a loop that ended is still a loop
    (PROSE, FinishReason.LENGTH, 60, Verdict.CUT),  # a long summary, not a loop: a retry would be cut alike
    (PROSE, FinishReason.LENGTH, 250, Verdict.CUT),
    (" \n ", FinishReason.STOP, 2, Verdict.EMPTY),
    ("", FinishReason.STOP, 0, Verdict.EMPTY),
]


@pytest.mark.parametrize(("text", "reason", "tokens", "expected"), VERDICTS)
def test_each_pass_is_judged(text: str, reason: FinishReason, tokens: int, expected: Verdict) -> None:
    judged = verdict(text, reason, tokens, HISTORY_TOKENS)
    assert judged is expected
    assert judged.degenerate == (expected in (Verdict.LOOP, Verdict.ECHO))


def test_the_first_pass_is_plain_greedy_and_the_one_retry_penalises_repetition() -> None:
    assert len(PASS_PENALTIES) == 2
    first, retry = (pass_sampling(512, attempt) for attempt in range(len(PASS_PENALTIES)))
    assert first == SamplingParams(max_tokens=512, temperature=0.0)
    assert not first.penalised
    assert retry == SamplingParams(max_tokens=512, temperature=0.0, repetition_penalty=PASS_PENALTIES[1])
    assert retry.repetition_penalty > 1.0


def test_the_watch_sees_a_loop_as_it_streams_and_only_at_its_checks() -> None:
    watch = LoopWatch()
    line = "Day 4: Belem 14:00, pasteis at 14:00, MAAT museum 14:00.\n\n"
    seen = [watch.add(line) for _ in range(4 * CHECK_EVERY)]
    first = seen.index(True)
    assert first + 1 == CHECK_EVERY  # 16 lines are 320 words and marks: a loop at the first look
    assert all(not flag for index, flag in enumerate(seen) if (index + 1) % CHECK_EVERY)


def test_the_watch_keeps_quiet_over_a_usable_summary() -> None:
    watch = LoopWatch()
    assert not any(watch.add(word + " ") for word in (ITINERARY + " " + WEEK + " " + PROSE).split())
