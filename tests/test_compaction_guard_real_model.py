"""Compaction on the embedded SmolLM2 of itinerary-style histories whose plain greedy summary degenerates.

Each history is a system message and 8 short exchanges of notes. Before the summary guard
(`courier/conversation/summary_guard.py`) the first three failed with 422 "the summary was cut at
max_output_tokens (1024)" (greedy decoding looped on one line: "Day 12: Belem 14:00, pasteis at 14:00, ...") and
the notes failed with 400 (the model copied the transcript back, longer than the history it replaces); with the
guard, the loop was stopped as soon as it showed and the retry, with a repetition penalty, ended on its own. Now
the summary's grammar (`grammar/summary.py`: bullet lines within one character per token replaced) bounds every
pass: each history compacts in one pass and none degenerates (the guard stays for summaries without a grammar).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest

from courier.conversation.summary_guard import looping
from tests.support.server import RunningServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful travel assistant. Keep answers short."
RETRY = re.compile(r"compaction summary pass 1 degenerated \((\w+)\)")
RETRIES: list[str] = []  # the retries the tests expect logged, in order: none now


def history(*exchanges: tuple[str, str]) -> list[dict[str, Any]]:
    items = [{"role": "system", "content": SYSTEM}]
    for question, answer in exchanges:
        items += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return items


ROME = history(
    ("Trip to Rome, 3-10 June. Flight AZ 611 lands FCO 08:50 on 3 June.", "Got it: AZ 611, FCO 08:50, 3 June."),
    (
        "Hotel: Albergo del Senato, 4 nights, confirmation 77821. Then Airbnb in Trastevere.",
        "Got it: Albergo del Senato x4, conf 77821, then Trastevere Airbnb.",
    ),
    ("4 June: Colosseum 09:15 ticket, Forum after, Palatine Hill.", "Got it: 4 June Colosseum 09:15, Forum, Palatine."),
    ("5 June: Vatican Museums 08:00, St Peter's dome 12:00.", "Got it: 5 June Vatican 08:00, dome 12:00."),
    ("6 June: Borghese Gallery 11:00 slot, Villa Borghese picnic.", "Got it: 6 June Borghese 11:00, picnic."),
    (
        "7 June: day trip Tivoli, Villa d'Este, bus from Ponte Mammolo 09:30.",
        "Got it: 7 June Tivoli, Villa d'Este, bus 09:30.",
    ),
    (
        "8 June: cooking class 16:00 in Trastevere, 85 euros each, 2 people.",
        "Got it: 8 June cooking class 16:00, 85 euros x2.",
    ),
    (
        "9 June: free day, maybe Ostia Antica. 10 June: flight AZ 610 at 15:20.",
        "Got it: 9 June free or Ostia, 10 June AZ 610 15:20.",
    ),
)
LISBON = history(
    (
        "Hi! I'm Ada, planning Lisbon 12-18 May with my dog Biscuit.",
        "Hi Ada! Lisbon with Biscuit, 12-18 May. How can I help?",
    ),
    ("Day 1 (12 May): land 10:20, flight TP1234, taxi to Alfama.", "Day 1: TP1234 lands 10:20, taxi to Alfama."),
    (
        "Day 2: Belem tower 09:00, pasteis at 11:00, MAAT museum 14:00.",
        "Day 2: Belem 09:00, pasteis 11:00, MAAT 14:00.",
    ),
    ("Day 3: Sintra, train 08:41 from Rossio, Pena Palace 10:30.", "Day 3: Sintra, 08:41 Rossio, Pena 10:30."),
    (
        "Day 4: beach day at Cascais with Biscuit, dog-friendly beach Praia da Conceicao.",
        "Day 4: Cascais, Praia da Conceicao with Biscuit.",
    ),
    (
        "Day 5: tram 28 at 09:00, Sao Jorge castle 11:00, fado dinner 20:00.",
        "Day 5: tram 28 09:00, castle 11:00, fado 20:00.",
    ),
    (
        "Day 6: LX Factory 10:00, Time Out Market lunch, vet check for Biscuit 16:00.",
        "Day 6: LX Factory 10:00, Time Out lunch, vet 16:00.",
    ),
    ("Day 7 (18 May): checkout 11:00, flight TP1235 at 15:45.", "Day 7: checkout 11:00, TP1235 15:45."),
)
CONFERENCE = history(
    (
        "Conference schedule, PyCon, 15 May: registration 08:00, keynote 09:00 hall A.",
        "15 May: registration 08:00, keynote 09:00 hall A.",
    ),
    ("15 May: talk 'Async in practice' 11:00 room 3, lunch 12:30.", "15 May: Async talk 11:00 room 3, lunch 12:30."),
    (
        "15 May: my talk at 15:00 in room 5, slides on USB and laptop.",
        "15 May: your talk 15:00 room 5, slides on USB and laptop.",
    ),
    (
        "16 May: keynote 09:00, sprint planning 10:30, booth duty 13:00-15:00.",
        "16 May: keynote 09:00, sprint planning 10:30, booth 13:00-15:00.",
    ),
    (
        "16 May: dinner with speakers 19:00 at Osteria Rossa, table for 12.",
        "16 May: speakers' dinner 19:00, Osteria Rossa, 12.",
    ),
    ("17 May: sprints all day, room 7, project: courier.", "17 May: sprints, room 7, courier."),
    ("18 May: checkout 11:00, train ICE 578 at 13:10.", "18 May: checkout 11:00, ICE 578 13:10."),
    ("Expenses so far: hotel 540 EUR, train 89 EUR, meals 120 EUR.", "Expenses: hotel 540, train 89, meals 120 EUR."),
)
NOTES = history(
    (
        "Notes for Monday: - standup 09:00 - call with Priya 11:00 - dentist 15:30",
        "Monday: standup 09:00, Priya 11:00, dentist 15:30.",
    ),
    (
        "Tuesday: - gym 07:00 - budget review 10:00 - pick up kids 16:00",
        "Tuesday: gym 07:00, budget review 10:00, kids 16:00.",
    ),
    (
        "Wednesday: - standup 09:00 - design review 13:00 - dinner with Sam 19:00",
        "Wednesday: standup 09:00, design review 13:00, dinner Sam 19:00.",
    ),
    (
        "Thursday: - gym 07:00 - 1:1 with Marco 14:00 - car service 17:00",
        "Thursday: gym 07:00, Marco 14:00, car service 17:00.",
    ),
    (
        "Friday: - standup 09:00 - release v2.3 at 12:00 - team drinks 18:00",
        "Friday: standup 09:00, release v2.3 12:00, drinks 18:00.",
    ),
    ("Saturday: - market 09:00 - football 11:00 - movie 20:00", "Saturday: market 09:00, football 11:00, movie 20:00."),
    ("Sunday: - brunch 11:00 with parents - laundry - prep week", "Sunday: brunch 11:00, laundry, prep week."),
    ("Next Monday: - flight to Berlin LH 2031 at 06:45 - hotel Motel One", "Next Monday: LH 2031 06:45, Motel One."),
)
HIKE = history(
    (
        "Hiking trip in the Dolomites, 1-8 August. Base: Ortisei, Hotel Alpenrose.",
        "Dolomites 1-8 August, base Ortisei, Hotel Alpenrose.",
    ),
    ("Day 1: Seceda cable car 09:00, ridge walk 3 hours.", "Day 1: Seceda 09:00, ridge 3 hours."),
    (
        "Day 2: Alpe di Siusi, trail 2 to Rifugio Molignon, lunch there.",
        "Day 2: Alpe di Siusi, trail 2, Rifugio Molignon.",
    ),
    ("Day 3: rest day, spa at 16:00.", "Day 3: rest, spa 16:00."),
    (
        "Day 4: Tre Cime loop, drive 1h40, parking 30 euros, start 07:30.",
        "Day 4: Tre Cime, start 07:30, parking 30 euros.",
    ),
    ("Day 5: Lago di Braies 08:00, rowboat 10:00.", "Day 5: Braies 08:00, rowboat 10:00."),
    (
        "Day 6: via ferrata Brigata Tridentina with guide Luca, meet 07:00.",
        "Day 6: Brigata Tridentina with Luca, 07:00.",
    ),
    (
        "Day 7: Val di Funes, photo at Santa Maddalena 18:30. "
        "Day 8: drive to Venice airport, flight EZY 8268 at 14:10.",
        "Day 7: Val di Funes 18:30. Day 8: EZY 8268 at 14:10.",
    ),
)


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> Iterator[RunningServer]:
    """The session's shared default SmolLM2 server (tests/conftest.py). When the module's tests are done, the log
    lines written since it began must show a retry for each degenerate summary and no other (a retry is logged
    while its compaction runs, before the reply that ends it)."""
    start = len(smollm2_server.lines)
    yield smollm2_server
    retries = [match.group(1) for line in smollm2_server.lines[start:] if (match := RETRY.search(line))]
    assert retries == RETRIES


def summary_of(item: dict[str, Any]) -> str:
    encoded = item["encrypted_content"]
    summary: str = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))["summary"]
    return summary


def compact(client: openai.OpenAI, items: list[dict[str, Any]]) -> str:
    """The summary of a compaction with the defaults (`max_output_tokens` 1024), checked usable."""
    compacted = client.responses.compact(model=MODEL, input=items)  # type: ignore[arg-type]
    output: list[Any] = [item.to_dict(warnings=False) for item in compacted.output]
    assert [item["type"] for item in output].count("compaction") == 1
    assert output[-1]["type"] == "compaction"
    assert (output[0]["role"], output[0]["content"][0]["text"]) == ("system", SYSTEM)
    assert output[-2]["content"][0]["text"] == items[-1]["content"]  # the latest turn is kept verbatim
    assert compacted.usage.output_tokens > 0
    summary = summary_of(output[-1])
    assert summary.strip()
    assert not looping(summary)
    return summary


@pytest.mark.parametrize(
    ("items", "fact"), [(ROME, "Rome"), (LISBON, None), (CONFERENCE, "15 May")], ids=["rome", "lisbon", "conference"]
)
def test_a_history_whose_plain_greedy_summary_looped_compacts_in_one_bounded_pass(
    client: openai.OpenAI, items: list[dict[str, Any]], fact: str | None
) -> None:
    summary = compact(client, items)
    assert fact is None or fact in summary


def test_notes_the_model_copied_back_compact_in_one_pass_shorter_than_they_were(client: openai.OpenAI) -> None:
    compact(client, NOTES)  # within one character per token replaced: shorter than the notes by construction


def test_a_history_whose_greedy_summary_is_usable_takes_one_pass(client: openai.OpenAI) -> None:
    summary = compact(client, HIKE)
    assert "Ortisei" in summary  # plain greedy copies the names faithfully (the server fixture checks: no retry)
