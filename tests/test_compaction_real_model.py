"""Compaction on the embedded SmolLM2: explicit compaction, replay, a capsule chain, automatic compaction."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from tests.http.test_prompt_cache import cache_stats, wait_until_idle
from tests.support.server import RunningServer, running_server

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
HISTORY: list[Any] = [
    {
        "role": "user",
        "content": "Hi! My name is Ada Lovelace and I am planning a trip to Lisbon in May with my dog Biscuit.",
    },
    {"role": "assistant", "content": "Nice to meet you, Ada! Lisbon in May is lovely. How can I help with the trip?"},
    {"role": "user", "content": "I need a hotel that accepts dogs, near the Alfama district, under 150 euros a night."},
    {
        "role": "assistant",
        "content": "Look at small guesthouses in Alfama; many accept dogs. Check each one's pet policy and the "
        "nightly price before booking.",
    },
    {"role": "user", "content": "Also remind me that my flight number is TP1234 leaving at 09:40."},
    {"role": "assistant", "content": "Noted: flight TP1234 departs at 09:40."},
    {"role": "user", "content": "What should I pack?"},
]
COMPACT_OPTIONS = {"keep_tokens": 40, "max_output_tokens": 300}
# The answers after a compaction are cut at a few tokens: what is checked is what they were given, not what they
# say (each token decoded costs ~90 ms).


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(cache_dir: Path, trace_file: Path) -> Iterator[RunningServer]:
    with running_server(["--cache-dir", str(cache_dir), "--trace-file", str(trace_file)]) as running:
        yield running
        assert running.stop() == 0
    the_compactor_traces_selection_counts_summary_and_capsule(trace_file)  # the server stopped: spans flushed


def capsule_of(item: dict[str, Any]) -> dict[str, Any]:
    encoded = item["encrypted_content"]
    payload: dict[str, Any] = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    return payload


def count(client: openai.OpenAI, **body: Any) -> int:
    return client.responses.input_tokens.count(model=MODEL, **body).input_tokens


def test_compact_then_continue_from_the_compacted_history(server: RunningServer, client: openai.OpenAI) -> None:
    before = count(client, input=HISTORY)
    warm_ups = cache_stats(server)["snapshot_warmups_queued"]
    compacted = client.responses.compact(model=MODEL, input=HISTORY, extra_body=COMPACT_OPTIONS)
    assert compacted.object == "response.compaction"
    output: list[Any] = [item.to_dict(warnings=False) for item in compacted.output]
    assert [item["type"] for item in output].count("compaction") == 1
    assert output[-1]["type"] == "compaction"
    retained_texts = [part["text"] for item in output[:-1] for part in item["content"]]
    assert retained_texts[-1] == "What should I pack?"  # the latest user message is kept verbatim
    assert not any("Lisbon" in text for text in retained_texts)  # the first turn was summarized...
    capsule = capsule_of(output[-1])
    assert capsule["v"] == 1
    facts = ("Ada", "Lisbon", "Biscuit", "Alfama", "TP1234")
    assert any(fact in capsule["summary"] for fact in facts)  # ...and its facts kept
    assert compacted.usage.output_tokens > 0

    wait_until_idle(server, queued_at_least=warm_ups + 1)  # the compacted prefix is prefilled while idle
    follow: list[Any] = [*output, {"role": "user", "content": "And what about the weather?"}]
    after = count(client, input=follow)
    assert after < before
    reply = client.responses.create(model=MODEL, input=follow, max_output_tokens=8, temperature=0)
    assert reply.usage is not None and reply.usage.input_tokens == after
    new_message = count(client, input="And what about the weather?")
    assert reply.usage.input_tokens_details.cached_tokens >= after - new_message  # it starts from the warm prefix

    # A capsule chain over three hops stays compacted: each hop renders the summary, not the old turns.
    hops = [reply]
    for question in ("Thanks! Anything else?", "Bye for now."):
        hops.append(
            client.responses.create(
                model=MODEL, previous_response_id=hops[-1].id, input=question, max_output_tokens=8, temperature=0
            )
        )
    spelled_out: list[Any] = [*follow]
    for hop, question in zip(hops[:2], ("Thanks! Anything else?", "Bye for now."), strict=True):
        spelled_out += [{"role": "assistant", "content": hop.output_text}, {"role": "user", "content": question}]
    last = hops[-1]
    assert last.usage is not None
    assert last.usage.input_tokens == count(client, input=spelled_out)
    assert last.usage.input_tokens == count(client, previous_response_id=hops[1].id, input="Bye for now.")
    assert last.usage.input_tokens < count(client, input=[*HISTORY, *spelled_out[len(output) :]])


def test_automatic_compaction_streams_its_item_then_the_answer(client: openai.OpenAI) -> None:
    before = count(client, input=HISTORY)
    with client.responses.stream(
        model=MODEL,
        input=HISTORY,
        max_output_tokens=8,
        temperature=0,
        extra_body={"context_management": [{"type": "compaction", "compact_threshold": 100}]},
    ) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[-1] != "response.failed", events[-1]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.compaction.compacting",
        "response.output_item.done",
    ]
    assert kinds[5] == "response.output_item.added"  # the answer's message
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final: Any = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output][:2] == ["compaction", "message"]
    assert final.usage.input_tokens < before
    stored = client.responses.retrieve(final.id)
    assert stored.output[0].type == "compaction"
    # The next hop replays the capsule from storage: it is not compacted again and stays small.
    follow = client.responses.create(
        model=MODEL, previous_response_id=final.id, input="Thanks!", max_output_tokens=8, temperature=0
    )
    assert follow.usage is not None and follow.usage.input_tokens < before


def the_compactor_traces_selection_counts_summary_and_capsule(trace_file: Path) -> None:
    """Checked when the module's tests are done and its server stopped (stopping flushes the spans)."""
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    by_id = {span["context"]["span_id"]: span for span in spans}

    def parent(span: dict[str, Any]) -> str | None:
        found = by_id.get(span["parent_id"]) if span["parent_id"] else None
        return found["name"] if found else None

    def children(name: str) -> list[str]:
        return [span["name"] for span in spans if parent(span) == name]

    compactions = [span for span in spans if span["name"] == "compactor.CompactHistory"]
    assert len(compactions) == 2  # the explicit one and the automatic one
    assert {parent(span) for span in compactions} == {"POST /v1/responses/compact", "POST /v1/responses"}
    under = children("compactor.CompactHistory")
    assert {"compactor.selection", "ingress.AdmitGeneration", "compactor.capsule"} <= set(under)
    counts = children("compactor.selection")
    assert counts and set(counts) == {"token_counter.TokenizeChat"}
    selection = next(span for span in spans if span["name"] == "compactor.selection")
    assert selection["attributes"]["courier.compaction.segments"] == len(counts) // 2
