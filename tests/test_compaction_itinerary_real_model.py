"""An ordinary itinerary history compacts on the embedded SmolLM2 (issue 30, item 2): a system message and ten
"Day i: museum i, cafe i" exchanges, explicitly and through `context_management`.

Greedy SmolLM2 summarizing an enumeration went on enumerating (Day 11, Day 12, ...) until `max_output_tokens`, and
the compaction was refused as cut (422). The summary's grammar (bullet lines within a budget of one character per
token replaced, `grammar/summary.py`) bounds it and lets it end.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from courier.grammar.summary import LINE_CHARS, MAX_LINES
from tests.support.server import RunningServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
DAYS = 10
TIMEOUT_S = 900.0


def itinerary() -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel assistant."}]
    for day in range(1, DAYS + 1):
        history.append({"role": "user", "content": f"Day {day}: museum {day}, cafe {day}"})
        history.append({"role": "assistant", "content": f"Noted. Day {day}: museum {day}, cafe {day}."})
    return history


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared SmolLM2 server (tests/conftest.py)


@pytest.fixture(scope="module")
def patient_http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        yield client


def summary_of(item: dict[str, Any]) -> str:
    encoded = item["encrypted_content"]
    capsule: dict[str, Any] = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    summary: str = capsule["summary"]
    return summary


def bounded(summary: str) -> None:
    lines = summary.splitlines()
    assert 0 < len(lines) <= MAX_LINES, summary
    assert all(line.startswith("- ") and len(line) <= LINE_CHARS + 2 for line in lines), summary


@pytest.mark.parametrize("follow_up", [False, True], ids=["history", "history-and-a-question"])
def test_the_itinerary_compacts_explicitly(patient_http: httpx.Client, follow_up: bool) -> None:
    history = itinerary() + ([{"role": "user", "content": "What is on day 3?"}] if follow_up else [])
    reply = patient_http.post("/v1/responses/compact", json={"model": MODEL, "input": history})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [item["type"] for item in output].count("compaction") == 1
    summary = summary_of(output[-1])
    bounded(summary)
    assert "Day" in summary or "museum" in summary  # about the itinerary
    usage = reply.json()["usage"]
    assert 0 < usage["output_tokens"] < usage["input_tokens"]


def test_the_itinerary_compacts_through_context_management(patient_http: httpx.Client) -> None:
    history = [*itinerary(), {"role": "user", "content": "What is on day 3?"}]
    counted = patient_http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": history})
    assert counted.status_code == 200, counted.text
    # The threshold is the history's own size: compaction is due and keeps up to half of it verbatim. Its summary
    # of the first days still runs on past day 10 until its budget, one character per token replaced, ends it; a
    # lower threshold replaces more and only makes that summary, the test's costliest generation, longer.
    threshold = counted.json()["input_tokens"]
    body = {
        "model": MODEL,
        "input": history,
        "context_management": [{"type": "compaction", "compact_threshold": threshold}],
        "max_output_tokens": 16,
        "store": False,
    }
    reply = patient_http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert output[0]["type"] == "compaction"
    bounded(summary_of(output[0]))
    assert any(item["type"] == "message" for item in output[1:])
