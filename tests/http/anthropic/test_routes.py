"""POST /v1/messages and /v1/messages/count_tokens through a real server, with the official Anthropic client.

On the package's 64K-window random model (conftest.py), in generic tool mode: whole and streamed messages in
Anthropic's order, usage that adds up to the count, every tool_choice, aliases, the prompt cache on a second turn,
an agent-sized max_tokens capped, a prompt past the window refused, keep-alives during a long prefill, and errors
in Anthropic's envelope with either header carrying the key.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest

from tests.http.anthropic.conftest import ALIAS, MODEL
from tests.http.anthropic.sse import check_order, read_events
from tests.support.agent_recorder import API_KEY, BEARER_KEY
from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection

WEATHER: Any = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def ask(text: str = "Say hello") -> Any:
    return [{"role": "user", "content": text}]


def fresh(prefix: str = "") -> str:
    """A system prompt no other test sends, so no test starts from another's cached state."""
    return f"{prefix}You are test {uuid.uuid4().hex}."


def total_input(usage: Any) -> int:
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0))


def test_a_message_is_answered_and_its_usage_adds_up_to_the_count(messages_client: anthropic.Anthropic) -> None:
    system = fresh()
    message = messages_client.messages.create(model=MODEL, max_tokens=50, system=system, messages=ask())
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert message.id.startswith("msg_") and message.stop_reason in ("end_turn", "max_tokens")
    assert all(block.type == "text" for block in message.content)
    counted = messages_client.messages.count_tokens(model=MODEL, system=system, messages=ask()).input_tokens
    assert total_input(message.usage) == counted
    assert message.usage.output_tokens >= 1


def test_aliases_name_the_model_and_the_reply_echoes_the_name(
    messages_client: anthropic.Anthropic, server: RunningServer
) -> None:
    for name in (ALIAS, "claude-opus-4-8[1m]", "claude-haiku-4-5-20251001"):
        assert messages_client.messages.create(model=name, max_tokens=5, messages=ask()).model == name
    with pytest.raises(anthropic.NotFoundError) as unknown:
        messages_client.messages.create(model="gpt-4o", max_tokens=5, messages=ask())
    assert unknown.value.body["error"]["type"] == "not_found_error"
    listed = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert [model["id"] for model in listed["data"]] == [MODEL, ALIAS]  # a pattern names no one model


PROMPT_FIELDS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def merged_as_claude_code_does(start: dict[str, int], delta: dict[str, int]) -> int:
    """The prompt a stream's usage adds up to as Claude Code merges it (its `updateUsage`, read from the binary): a
    field of `message_delta` replaces `message_start`'s only when it is above 0."""
    return sum(delta[field] if delta.get(field, 0) > 0 else start.get(field, 0) for field in PROMPT_FIELDS)


def test_a_stream_keeps_anthropics_order_and_adds_up_however_a_client_merges_its_usage(
    keyed_http: httpx.Client,
) -> None:
    """Two turns of one conversation, the second served from the prompt cache: its usage adds up to the count as the
    SDKs merge it (`message_delta`'s figures win) and as Claude Code does (only figures above 0 win)."""
    system, session = fresh(), {"user_id": f"session-{uuid.uuid4().hex}"}
    history = ask()
    for turn in range(2):
        body = {"model": MODEL, "max_tokens": 64, "system": system, "messages": history, "metadata": session}
        with keyed_http.stream("POST", "/v1/messages?beta=true", json={**body, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = check_order(read_events(response))
        counted = keyed_http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        started, (_, delta), _ = events[0][1], events[-2], events[-1]
        start = started["message"]["usage"]
        assert start["input_tokens"] == counted  # before the cache split is known
        assert started["message"]["content"] == [] and started["message"]["stop_reason"] is None
        final = delta["usage"]
        assert sum(final[field] for field in PROMPT_FIELDS) == counted
        assert merged_as_claude_code_does(start, final) == counted
        assert (final["cache_read_input_tokens"] > 0) == (turn == 1), final
        assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
        text = "".join(data["delta"].get("text", "") for name, data in events if name == "content_block_delta")
        history = [*history, {"role": "assistant", "content": text or "..."}, *ask("And again?")]


def test_the_sdks_stream_helper_gets_the_final_message(messages_client: anthropic.Anthropic) -> None:
    with messages_client.messages.stream(model=MODEL, max_tokens=64, system=fresh(), messages=ask()) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(block.text for block in final.content if block.type == "text") == text
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_a_forced_call_streams_as_one_tool_use_block(keyed_http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "system": fresh(),
        "messages": ask("Weather in Paris?"),
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "stream": True,
    }
    with keyed_http.stream("POST", "/v1/messages", json=body) as response:
        events = check_order(read_events(response))
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    block = events[1][1]["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    assert block["id"].startswith("toolu_")
    arguments = json.loads(events[2][1]["delta"]["partial_json"])
    assert list(arguments) == ["city"] and isinstance(arguments["city"], str)
    assert events[4][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize(
    ("choice", "calls"),
    [
        ({"type": "tool", "name": "get_weather"}, "one"),
        ({"type": "any", "disable_parallel_tool_use": True}, "one"),
        ({"type": "any"}, "some"),
        ({"type": "none"}, "none"),
        ({"type": "auto"}, "any"),
    ],
)
def test_each_tool_choice_in_generic_mode(messages_client: anthropic.Anthropic, choice: Any, calls: str) -> None:
    system = fresh()
    message = messages_client.messages.create(
        model=MODEL, max_tokens=200, system=system, messages=ask("Weather?"), tools=[WEATHER], tool_choice=choice
    )
    used = [block for block in message.content if block.type == "tool_use"]
    assert all(block.type in ("text", "tool_use") for block in message.content)
    assert all(block.name == "get_weather" and isinstance(block.input.get("city"), str) for block in used)
    if calls == "one":
        assert len(used) == 1 and message.stop_reason == "tool_use"
    elif calls == "some":
        # Parallel calls allowed: a random model may go on calling until the reply is cut, which is then said so.
        assert used
        cut = message.stop_reason == "max_tokens" and message.usage.output_tokens == 200
        assert message.stop_reason == "tool_use" or cut, message
    elif calls == "none":
        assert not used
        count = messages_client.messages.count_tokens
        with_none = count(model=MODEL, system=system, messages=ask("Weather?"), tools=[WEATHER], tool_choice=choice)
        assert with_none.input_tokens == count(model=MODEL, system=system, messages=ask("Weather?")).input_tokens


def test_a_tool_result_turn_is_answered(messages_client: anthropic.Anthropic) -> None:
    system = fresh()
    first = messages_client.messages.create(
        model=MODEL,
        max_tokens=200,
        system=system,
        messages=ask("Weather?"),
        tools=[WEATHER],
        tool_choice={"type": "any"},
    )
    call = next(block for block in first.content if block.type == "tool_use")
    results = [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]},
        {"type": "tool_result", "tool_use_id": "toolu_other", "content": "timed out", "is_error": True},
    ]
    history: list[Any] = [
        *ask("Weather?"),
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    second = messages_client.messages.create(
        model=MODEL, max_tokens=50, system=system, messages=history, tools=[WEATHER]
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the first turn's prompt, and its reply warmed up after it


def test_a_second_turn_reads_the_prompt_cache(messages_client: anthropic.Anthropic) -> None:
    system = fresh("Answer briefly. " * 20)
    session: Any = {"user_id": f"session-{uuid.uuid4().hex}"}
    first = messages_client.messages.create(model=MODEL, max_tokens=20, system=system, messages=ask(), metadata=session)
    assert not first.usage.cache_read_input_tokens
    history: list[Any] = [*ask(), {"role": "assistant", "content": first.content or "..."}, *ask("And again?")]
    second = messages_client.messages.create(
        model=MODEL, max_tokens=20, system=system, messages=history, metadata=session
    )
    assert (second.usage.cache_read_input_tokens or 0) >= total_input(first.usage) // 2


def test_a_json_schema_answer_is_json(messages_client: anthropic.Anthropic) -> None:
    schema: Any = {
        "type": "object",
        "properties": {"title": {"type": "string"}},
        "required": ["title"],
        "additionalProperties": False,
    }
    message = messages_client.messages.create(
        model=MODEL,
        max_tokens=300,
        system=fresh(),
        messages=ask(),
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert message.stop_reason == "end_turn"
    assert list(json.loads("".join(b.text for b in message.content if b.type == "text"))) == ["title"]


def test_max_tokens_past_the_window_is_capped(keyed_http: httpx.Client) -> None:
    """Agents ask for 32,000-128,000 output tokens on every call: more than the window holds, served anyway."""
    body = {"model": MODEL, "max_tokens": 1_000_000, "system": fresh(), "messages": ask()}
    assert keyed_http.post("/v1/messages", json=body).status_code == 200
    with keyed_http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        check_order(read_events(response))


def test_a_reply_cut_by_the_window_not_by_max_tokens_says_so(tiny_server: RunningServer) -> None:
    """On the shared tiny server (a small window): a prompt that leaves 3 tokens of room, and max_tokens far past it.
    The reply is cut by the window: `model_context_window_exceeded` (Claude Code then says the window was reached),
    where a reply cut by its own max_tokens says `max_tokens`."""
    with tiny_server.http() as http:
        (model,) = http.get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()["data"]
        window, words = int(model["max_input_tokens"]), int(model["max_input_tokens"])

        def body(count: int, max_tokens: int) -> dict[str, Any]:
            messages = ask("Count the words. " + "hi " * count)  # greedy on a fixed prompt: the same reply each run
            return {"model": model["id"], "max_tokens": max_tokens, "messages": messages, "temperature": 0}

        for _ in range(4):  # each "hi " is about one token: fitted to leave exactly 3
            counted = http.post("/v1/messages/count_tokens", json=body(words, 1)).json()["input_tokens"]
            words -= counted - (window - 3)
        whole = http.post("/v1/messages", json=body(words, 1_000_000)).json()
        assert (whole["stop_reason"], whole["usage"]["output_tokens"]) == ("model_context_window_exceeded", 3), whole
        with http.stream("POST", "/v1/messages", json={**body(words, 1_000_000), "stream": True}) as response:
            events = check_order(read_events(response))
        assert events[-2][1]["delta"]["stop_reason"] == "model_context_window_exceeded"
        own = http.post("/v1/messages", json=body(words, 2)).json()
        assert (own["stop_reason"], own["usage"]["output_tokens"]) == ("max_tokens", 2), own


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_past_the_window_is_refused_before_any_prefill(keyed_http: httpx.Client, stream: bool) -> None:
    body = {"model": MODEL, "max_tokens": 100, "messages": ask("hello " * 70_000), "stream": stream}
    reply = keyed_http.post("/v1/messages", json=body)
    assert reply.status_code == 400
    error = reply.json()
    assert (error["type"], error["error"]["type"]) == ("error", "invalid_request_error")
    assert error["error"]["message"].startswith("prompt is too long: ")
    assert error["error"]["code"] == "context_length_exceeded"


def test_keep_alives_while_a_long_prompt_prefills(keyed_http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 8, "system": fresh(), "messages": ask("hello " * 40_000), "stream": True}
    with keyed_http.stream("POST", "/v1/messages", json=body) as response:
        names = [name for name, _ in read_events(response)]
    before_reply = names[: next(i for i, name in enumerate(names) if name in ("content_block_start", "message_delta"))]
    assert before_reply[0] == "message_start" and before_reply.count("ping") >= 1, names


def test_errors_answer_in_anthropics_envelope(keyed_http: httpx.Client, server: RunningServer) -> None:
    refusals = [
        (keyed_http.post("/v1/messages", content=b"{not json"), 400, "invalid_request_error", None),
        (
            keyed_http.post("/v1/messages", json={"model": MODEL, "messages": ask()}),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            keyed_http.post(
                "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": ask(), "temperature": 2}
            ),
            400,
            "invalid_request_error",
            "temperature",
        ),
        (httpx.post(f"{server.base_url}/v1/messages", json={}), 401, "authentication_error", None),
        (
            httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={}, headers={"x-api-key": "sk-wrong"}),
            401,
            "authentication_error",
            None,
        ),
        (
            keyed_http.post("/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": ask()}),
            404,
            "not_found_error",
            "model",
        ),
    ]
    for reply, status, kind, param in refusals:
        assert reply.status_code == status, reply.text
        body = reply.json()
        assert (body["type"], body["error"]["type"], body["error"]["param"]) == ("error", kind, param), body
        assert body["error"]["message"]
    openai_route = keyed_http.post("/v1/chat/completions", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert set(openai_route.json()) == {"error"}  # the OpenAI routes keep OpenAI's envelope


def test_a_route_or_method_not_served_answers_an_anthropic_client_in_its_envelope(
    messages_client: anthropic.Anthropic, keyed_http: httpx.Client, server: RunningServer
) -> None:
    """No route matched, the client's `anthropic-version` decides: its key is read from x-api-key and the answer is a
    404 or 405 in Anthropic's envelope, not a 401 that sends its user looking at the key."""
    with pytest.raises(anthropic.NotFoundError) as batches:
        messages_client.messages.batches.list()
    assert (batches.value.body["type"], batches.value.body["error"]["type"]) == ("error", "not_found_error")
    version = {"anthropic-version": "2023-06-01"}
    refusals = [
        (keyed_http.get("/v1/messages", headers=version), 405, "invalid_request_error"),
        (keyed_http.post("/v1/complete", json={}, headers=version), 404, "not_found_error"),
        (httpx.get(f"{server.base_url}/v1/messages", headers=version), 401, "authentication_error"),
    ]
    for reply, status, kind in refusals:
        assert reply.status_code == status, reply.text
        assert (reply.json()["type"], reply.json()["error"]["type"]) == ("error", kind)
    unknown = keyed_http.post("/v1/complete", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert set(unknown.json()) == {"error"}  # no anthropic-version: OpenAI's envelope, as before


def test_a_tools_input_examples_reach_the_model(keyed_http: httpx.Client) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": ask("Weather?"), "tools": [WEATHER]}
    examples = {**WEATHER, "input_examples": [{"city": "Paris"}, {"city": "Lima"}]}
    without = keyed_http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    counted = keyed_http.post("/v1/messages/count_tokens", json={**body, "tools": [examples]})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > without
    too_many = {**WEATHER, "input_examples": [{}] * 33}
    refused = keyed_http.post("/v1/messages/count_tokens", json={**body, "tools": [too_many]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[0].input_examples"


def test_both_headers_carry_the_key(server: RunningServer) -> None:
    request: Any = {"model": MODEL, "max_tokens": 5, "messages": ask()}
    with anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0) as by_api_key:
        assert by_api_key.messages.create(**request).type == "message"  # x-api-key
    with anthropic.Anthropic(base_url=server.base_url, auth_token=BEARER_KEY, max_retries=0) as by_token:
        assert by_token.messages.create(**request).type == "message"  # Authorization: Bearer
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong", max_retries=0)
    with wrong, pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(**request)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_the_beta_headers_claude_code_sends_are_accepted(keyed_http: httpx.Client) -> None:
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }
    body = {"model": "claude-opus-4-8", "max_tokens": 5, "messages": ask()}
    reply = keyed_http.post("/v1/messages?beta=true", json=body, headers=headers)
    assert reply.status_code == 200 and orjson.loads(reply.content)["type"] == "message"


def test_clearing_tool_uses_is_refused_naming_the_edit(messages_client: anthropic.Anthropic) -> None:
    edits = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}, {"type": "clear_tool_uses_20250919"}]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages_client.messages.create(
            model=MODEL, max_tokens=5, messages=ask(), extra_body={"context_management": edits}
        )
    error: Any = refused.value.body
    assert error["error"]["param"] == "context_management.edits[1]"
    assert "clear_tool_uses_20250919" in error["error"]["message"]
