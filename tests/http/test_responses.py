"""The Responses and Conversations APIs end to end: a real server (tiny llama), the official openai client."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.support.server import TINY_MODEL, RunningServer, running_server

MODEL = TINY_MODEL
# Long enough (> --prompt-cache-min-prefix tokens) that a turn's history is worth caching.
INSTRUCTIONS = (
    "You are a careful assistant for a lighthouse keeper on a remote island. Answer briefly, name the tools you "
    "would use, and keep a log of every ship you are told about, with its name, its flag and the hour it passed."
)
# The chat template's generation prompt (`<|im_start|>assistant\n`): prompt tokens a history snapshot cannot hold.
GENERATION_PROMPT_TOKENS = 3


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def test_create_returns_a_stored_response_in_openai_shape(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Which ships passed tonight?",
        instructions=INSTRUCTIONS,
        max_output_tokens=8,
        temperature=0,
        metadata={"shift": "night"},
    )
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.model == MODEL
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == INSTRUCTIONS
    assert response.metadata == {"shift": "night"}
    assert response.to_dict()["store"] is True
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == "".join(part.text for part in message.content if part.type == "output_text")
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()


def test_usage_validates_against_the_sdk_types_strictly(client: openai.OpenAI, http: httpx.Client) -> None:
    """`input_tokens_details.cache_write_tokens` (required by the SDK's types): the prompt tokens beyond the cached
    ones whose state the turn handed to the prompt cache."""
    body = {"model": MODEL, "input": "Which ships passed tonight?", "max_output_tokens": 4, "temperature": 0}
    created = http.post("/v1/responses", json=body).json()
    details = created["usage"]["input_tokens_details"]
    assert details["cache_write_tokens"] == created["usage"]["input_tokens"] - details["cached_tokens"] > 0
    Response.model_validate(created)  # every required field there, each of its type
    stored = http.get(f"/v1/responses/{created['id']}").json()
    assert Response.model_validate(stored).usage == Response.model_validate(created).usage
    again = http.post("/v1/responses", json=body).json()["usage"]  # the same prompt: read, not written again
    assert again["input_tokens_details"]["cached_tokens"] > 0
    written = again["input_tokens_details"]["cache_write_tokens"]
    assert written == again["input_tokens"] - again["input_tokens_details"]["cached_tokens"]
    uncached = http.post("/v1/responses", json={**body, "cache_prompt": False}).json()["usage"]
    assert uncached["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    streamed = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, stream=True)
    final = [event for event in streamed if event.type in ("response.completed", "response.incomplete")]
    assert final[0].response.usage is not None
    details = final[0].response.usage.input_tokens_details
    assert details.cache_write_tokens == final[0].response.usage.input_tokens - details.cached_tokens


def test_stream_sends_the_full_event_sequence(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input="Log the ship Aurora.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    # 12 tokens of a random-weight model: cut short (response.incomplete) unless it happened to stop.
    final = events[-1].response  # type: ignore[union-attr]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_delete_removes_the_response(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(model=MODEL, input="Forget this.", max_output_tokens=2)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    gone = http.delete(f"/v1/responses/{response.id}")
    assert gone.status_code == 404
    assert gone.json()["error"]["code"] == "not_found"


def test_unstored_response_cannot_be_retrieved(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Off the record.", max_output_tokens=2, store=False)
    assert response.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_input_items_are_paginated(client: openai.OpenAI) -> None:
    items: Any = [
        {"role": "developer", "content": "Log ships only."},
        {"role": "user", "content": "The Aurora passed at nine."},
        {"role": "assistant", "content": "Logged the Aurora."},
        {"role": "user", "content": [{"type": "input_text", "text": "The Borealis passed at ten."}]},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=2)
    newest_first = client.responses.input_items.list(response.id)
    assert [item.role for item in newest_first.data] == ["user", "assistant", "user", "developer"]  # type: ignore[union-attr]
    first = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert first.has_more is True
    assert [item.role for item in first.data] == ["developer", "user", "assistant"]  # type: ignore[union-attr]
    rest = client.responses.input_items.list(response.id, order="asc", limit=3, after=first.data[-1].id)
    assert rest.has_more is False
    assert [item.id for item in rest.data] == [newest_first.data[0].id]
    every = [item.id for item in client.responses.input_items.list(response.id, order="asc", limit=2)]
    assert every == [item.id for item in reversed(newest_first.data)]


def test_input_tokens_count_what_create_prefills(client: openai.OpenAI) -> None:
    body: dict[str, Any] = {"input": "How many ships passed?", "instructions": INSTRUCTIONS}
    counted = client.responses.input_tokens.count(model=MODEL, **body)
    assert counted.object == "response.input_tokens"
    created = client.responses.create(model=MODEL, max_output_tokens=2, **body)
    assert created.usage is not None
    assert counted.input_tokens == created.usage.input_tokens


def test_a_three_hop_chain_rebuilds_its_history_and_hits_the_cache(client: openai.OpenAI) -> None:
    questions = ["The Aurora passed at nine.", "The Borealis passed at ten.", "Which ships passed?"]
    hops: list[Any] = []
    for question in questions:
        previous = hops[-1].id if hops else None
        counted = client.responses.input_tokens.count(
            model=MODEL, input=question, instructions=INSTRUCTIONS, previous_response_id=previous
        )
        hop = client.responses.create(
            model=MODEL,
            input=question,
            instructions=INSTRUCTIONS,
            previous_response_id=previous,
            prompt_cache_key="chain-test",
            max_output_tokens=6,
            temperature=0,
        )
        assert hop.previous_response_id == previous
        assert hop.usage is not None and hop.usage.input_tokens == counted.input_tokens
        hops.append(hop)
    # The whole history, spelled out by hand, renders to the same prompt as the chain rebuilt from storage.
    spelled_out: list[Any] = []
    for question, hop in zip(questions[:2], hops[:2], strict=True):
        spelled_out += [{"role": "user", "content": question}, {"role": "assistant", "content": hop.output_text}]
    spelled_out.append({"role": "user", "content": questions[2]})
    by_hand = client.responses.input_tokens.count(model=MODEL, input=spelled_out, instructions=INSTRUCTIONS)
    assert hops[2].usage.input_tokens == by_hand.input_tokens
    # Every hop from the second reuses the previous hop's whole prompt from the prompt cache.
    for previous, hop in pairwise(hops):
        cached = hop.usage.input_tokens_details.cached_tokens
        assert cached >= previous.usage.input_tokens - GENERATION_PROMPT_TOKENS


def test_conversation_round_trip(client: openai.OpenAI) -> None:
    conversation = client.conversations.create(
        metadata={"keeper": "Ada"}, items=[{"type": "message", "role": "user", "content": "Start the log."}]
    )
    assert conversation.id.startswith("conv_")
    assert client.conversations.retrieve(conversation.id).metadata == {"keeper": "Ada"}
    turns = []
    for question in ("The Aurora passed at nine.", "Which ships passed?"):
        turn = client.responses.create(
            model=MODEL,
            input=question,
            instructions=INSTRUCTIONS,
            conversation=conversation.id,
            max_output_tokens=6,
            temperature=0,
            user="conversation-test",
        )
        assert turn.conversation is not None and turn.conversation.id == conversation.id
        turns.append(turn)
    assert turns[1].usage is not None and turns[0].usage is not None
    assert turns[1].usage.input_tokens_details.cached_tokens >= turns[0].usage.input_tokens - GENERATION_PROMPT_TOKENS

    items = client.conversations.items.list(conversation.id, order="asc")
    roles = [(item.type, getattr(item, "role", None)) for item in items.data]
    assert roles == [("message", "user"), ("message", "user"), ("message", "assistant")] * 1 + [
        ("message", "user"),
        ("message", "assistant"),
    ]
    assert items.data[2].id == turns[0].output[0].id
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Note: fog."}])
    assert len(added.data) == 1
    item_id = added.data[0].id
    assert item_id is not None
    fetched = client.conversations.items.retrieve(item_id, conversation_id=conversation.id)
    assert fetched.id == item_id
    client.conversations.items.delete(item_id, conversation_id=conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(item_id, conversation_id=conversation.id)

    updated = client.conversations.update(conversation.id, metadata={"keeper": "Grace"})
    assert updated.metadata == {"keeper": "Grace"}
    deleted = client.conversations.delete(conversation.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)


def test_cancel_of_a_finished_response_is_refused(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(model=MODEL, input="Done already.", max_output_tokens=2)
    refused = http.post(f"/v1/responses/{response.id}/cancel")
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "response_not_cancellable"


ERRORS: list[tuple[str, str, dict[str, Any] | None, int, str | None]] = [
    ("GET", "/v1/responses/resp_unknown", None, 404, "response_id"),
    ("DELETE", "/v1/responses/resp_unknown", None, 404, "response_id"),
    ("POST", "/v1/responses/resp_unknown/cancel", {}, 404, "response_id"),
    ("GET", "/v1/responses/resp_unknown/input_items", None, 404, "response_id"),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ("POST", "/v1/responses", {"input": "hi", "conversation": "conv_unknown"}, 404, "conversation"),
    (
        "POST",
        "/v1/responses",
        {"input": "hi", "conversation": "conv_x", "previous_response_id": "resp_x"},
        400,
        "conversation",
    ),
    ("POST", "/v1/responses", {"input": "hi", "background": True}, 400, "background"),
    ("POST", "/v1/responses", {"input": "hi", "tools": [{"type": "teleporter"}]}, 400, "tools[0].type"),
    (
        "POST",
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "file_search"}], "tool_choice": {"type": "file_search"}},
        400,
        "tool_choice",
    ),
    ("POST", "/v1/responses", {"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ("POST", "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
    ("POST", "/v1/responses", {"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ("POST", "/v1/responses", {"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),  # no tools
    (
        "POST",
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
        400,
        "tool_choice",
    ),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("POST", "/v1/responses", {"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ("POST", "/v1/responses", {"input": "hi", "model": "gpt-9"}, 404, "model"),
    ("POST", "/v1/responses", {}, 400, "input"),
    ("POST", "/v1/responses", {"input": []}, 400, "input"),
    ("POST", "/v1/responses", {"input": [{"type": "web_search_call"}]}, 400, "input[0].type"),
    ("POST", "/v1/responses", {"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ("POST", "/v1/responses", {"input": [{"role": {}, "content": "hi"}]}, 400, "input[0].role"),
    ("POST", "/v1/responses", {"input": [{"type": {}, "encrypted_content": "0"}]}, 400, "input[0].type"),
    ("POST", "/v1/responses", {"input": [{"role": "user", "content": [{"type": []}]}]}, 400, "input[0].content[0]"),
    ("POST", "/v1/conversations", {"items": [{"type": {}}]}, 400, "items[0].type"),
    (
        "POST",
        "/v1/responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        400,
        "input[0].content[0]",
    ),
    (
        "POST",
        "/v1/responses/input_tokens",
        {"input": "hi", "previous_response_id": "resp_unknown"},
        404,
        "previous_response_id",
    ),
    ("GET", "/v1/conversations/conv_unknown", None, 404, "conversation"),
    ("DELETE", "/v1/conversations/conv_unknown", None, 404, "conversation"),
    ("GET", "/v1/conversations/conv_unknown/items", None, 404, "conversation"),
    ("POST", "/v1/conversations", {"metadata": "not an object"}, 400, "metadata"),
    ("POST", "/v1/conversations", {"items": [{"type": "message", "role": "user"}]}, 400, "items[0].content"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), ERRORS)
def test_errors_are_openai_envelopes(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, status: int, param: str | None
) -> None:
    reply = http.request(method, path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert http.get("/health").status_code == 200


def test_bad_pagination_is_refused(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.responses.create(model=MODEL, input="Page me.", max_output_tokens=2)
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"), ("after=msg_x", "after")):
        reply = http.get(f"/v1/responses/{response.id}/input_items?{query}")
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == param


def test_cancel_stops_an_in_flight_stream(client: openai.OpenAI, server: RunningServer) -> None:
    events: list[Any] = []
    cancelled: Any = None
    stream = client.responses.create(
        model=MODEL, input="Tell me everything you know.", max_output_tokens=1500, temperature=0, stream=True
    )
    with stream, server.openai_client() as other:
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta" and cancelled is None:
                response_id = events[0].response.id
                assert other.responses.retrieve(response_id).status == "in_progress"
                with pytest.raises(openai.BadRequestError):
                    other.responses.delete(response_id)
                cancelled = other.responses.cancel(response_id)
    terminal = events[-1]
    assert terminal.type == "response.incomplete"
    assert terminal.response.status == "cancelled"
    assert cancelled is not None and cancelled.status == "cancelled"
    assert cancelled.id == terminal.response.id
    assert client.responses.retrieve(cancelled.id).status == "cancelled"
    with server.http() as http:
        scheduler = http.get("/health").json()["scheduler"]
    assert (scheduler["running"], scheduler["waiting"]) == (0, 0)


def test_stored_responses_and_conversations_survive_a_kill(
    tiny_llama_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    args += ["--data-dir", str(tmp_path / "data")]
    with running_server(args) as first, first.openai_client() as client:
        conversation = client.conversations.create(metadata={"keeper": "Ada"})
        in_conversation = client.responses.create(
            model=MODEL, input="The Aurora passed.", conversation=conversation.id, max_output_tokens=4
        )
        chain = [client.responses.create(model=MODEL, input="The Borealis passed.", max_output_tokens=4)]
        chain.append(
            client.responses.create(
                model=MODEL, input="Which ships?", previous_response_id=chain[0].id, max_output_tokens=4
            )
        )
        items = client.conversations.items.list(conversation.id).model_dump()
        first.process.kill()  # no drain, no clean close of the database
        first.process.wait()
    with running_server(args) as second, second.openai_client() as client:
        for response in (in_conversation, *chain):
            assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
        assert client.conversations.retrieve(conversation.id).metadata == {"keeper": "Ada"}
        assert client.conversations.items.list(conversation.id).model_dump() == items
        third = client.responses.create(
            model=MODEL, input="And now?", previous_response_id=chain[1].id, max_output_tokens=4
        )
        counted = client.responses.input_tokens.count(
            model=MODEL,
            input=[
                {"role": "user", "content": "The Borealis passed."},
                {"role": "assistant", "content": chain[0].output_text},
                {"role": "user", "content": "Which ships?"},
                {"role": "assistant", "content": chain[1].output_text},
                {"role": "user", "content": "And now?"},
            ],
        )
        assert third.usage is not None and third.usage.input_tokens == counted.input_tokens
        assert second.stop() == 0


def test_api_prefix_nests_every_route(tiny_llama_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--api-prefix", "/courier"]) as server:
        with openai.OpenAI(base_url=f"{server.base_url}/courier/v1", api_key="x", max_retries=0) as client:
            response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
            assert client.responses.retrieve(response.id).id == response.id
            chat = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2
            )
            assert chat.choices[0].message.content is not None
        with server.http() as http:
            assert http.get("/courier/health").status_code == 200
            assert http.get("/courier/v1/models").json()["data"][0]["id"] == MODEL
            unprefixed = http.get("/v1/models")
            assert unprefixed.status_code == 404
            assert unprefixed.json()["error"]["code"] == "unknown_route"
        assert server.stop() == 0


def test_a_deadline_mid_stream_ends_incomplete_with_what_was_written(tiny_llama_dir: Path, cache_dir: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--request-timeout", "0.5"]) as server, server.openai_client() as client:
        stream = client.responses.create(
            model=MODEL,
            input="Go on and on.",
            max_output_tokens=1500,
            temperature=0,
            stream=True,
            extra_body={"logit_bias": {"0": -100, "2": -100}},  # no end token: the deadline ends it
        )
        with stream:
            events = list(stream)
        terminal: Any = events[-1]
        assert terminal.type == "response.incomplete"
        assert terminal.response.incomplete_details.reason == "max_output_tokens"
        assert terminal.response.output_text
        stored = client.responses.retrieve(terminal.response.id)
        assert (stored.status, stored.output_text) == ("incomplete", terminal.response.output_text)
        with server.http() as http:
            scheduler = http.get("/health").json()["scheduler"]
        assert (scheduler["running"], scheduler["waiting"]) == (0, 0)
        assert server.stop() == 0
