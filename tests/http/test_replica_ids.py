"""A replica's response ids (`--replica-id`) end to end: they carry its token, and every path that takes an id
takes them (a chain's next turn, retrieve, input items, a stream, delete)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from courier.conversation.ids import replica_of
from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
ROUTED_ID = re.compile(r"resp_r7\.[0-9a-f]{32}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(tiny_llama_dir, cache_dir, MODEL, "--replica-id", "r7") as running:
        yield running


def test_a_chain_of_routed_ids_is_stored_continued_read_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Name a ship.", max_output_tokens=2, temperature=0)
    assert ROUTED_ID.fullmatch(first.id) and replica_of(first.id) == "r7"
    second = client.responses.create(
        model=MODEL, input="And another.", previous_response_id=first.id, max_output_tokens=2, temperature=0
    )
    assert ROUTED_ID.fullmatch(second.id) and second.id != first.id
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).id == second.id
    assert [item.id for item in client.responses.input_items.list(second.id)]
    with client.responses.create(
        model=MODEL, input="A third.", previous_response_id=second.id, max_output_tokens=2, stream=True
    ) as stream:
        events = list(stream)
    streamed = events[-1].response  # type: ignore[union-attr]
    assert {event.response.id for event in events if hasattr(event, "response")} == {streamed.id}
    assert ROUTED_ID.fullmatch(streamed.id)
    client.responses.delete(streamed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_every_answer_names_the_replica_that_gave_it(server: RunningServer) -> None:
    with server.http() as http:
        answers = [
            http.get("/health"),
            http.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "max_tokens": 1}),  # a 400
            http.get("/v1/responses/resp_r7.00000000000000000000000000000000"),  # a 404
        ]
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
        ) as streamed:
            answers.append(streamed)
            assert "data: [DONE]" in streamed.read().decode()
    assert [answer.status_code for answer in answers] == [200, 400, 404, 200]
    assert {answer.headers.get("x-courier-replica") for answer in answers} == {"r7"}
