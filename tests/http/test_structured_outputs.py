"""Structured outputs and forced tool calls end to end: a real server (tiny random-weight llama, whose template has
no tools, so Courier's generic tool format), the official openai client and plain HTTP."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from courier.grammar.constraint import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH
from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe the weather as JSON."}]
# Bounded: whatever random weights pick, a reply ends within ~30 tokens.
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["clear", "cloudy", "rain"]},
        "windy": {"type": "boolean"},
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["sky", "windy", "celsius", "note"],
    "additionalProperties": False,
}
WEATHER_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True},
}
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
RESPONSES_TOOL: Any = {"type": "function", **TOOL["function"]}


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def deep(containers: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(containers - 1):
        schema = {"type": "array", "items": schema}
    return schema


def chat_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def text_schema(schema: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "x", "schema": schema}}


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
RESPONSES = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
TOO_BIG = {"type": "string", "description": "x" * MAX_SCHEMA_BYTES}
NAMED_CHAT: Any = {"type": "function", "function": {"name": "get_weather"}}
NAMED_RESPONSES = {"type": "function", "name": "get_weather"}
BAD_TOOL = {"type": "function", "function": {**TOOL["function"], "parameters": {"type": "object", "not": {}}}}

REFUSALS: list[tuple[str, str, dict[str, Any], str]] = [
    # id, path, body, param
    ("chat type", "/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    (
        "chat no schema",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        "chat keyword",
        "/v1/chat/completions",
        {**CHAT, "response_format": chat_schema({"type": "array", "uniqueItems": True})},
        "response_format.json_schema.schema",
    ),
    (
        "chat keyword streamed",
        "/v1/chat/completions",
        {**CHAT, "stream": True, "response_format": chat_schema({"not": {"type": "string"}})},
        "response_format.json_schema.schema",
    ),
    (
        "chat $ref",
        "/v1/chat/completions",
        {**CHAT, "response_format": chat_schema({"$ref": "#/$defs/missing"})},
        "response_format.json_schema.schema",
    ),
    (
        "chat too big",
        "/v1/chat/completions",
        {**CHAT, "response_format": chat_schema(TOO_BIG)},
        "response_format.json_schema.schema",
    ),
    (
        "chat too deep",
        "/v1/chat/completions",
        {**CHAT, "response_format": chat_schema(deep(MAX_SCHEMA_DEPTH + 1))},
        "response_format.json_schema.schema",
    ),
    (
        "chat named not a tool",
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
    ),
    ("chat required, no tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        "chat choice in Responses' shape",
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": NAMED_RESPONSES},
        "tool_choice",
    ),
    (
        "chat strict tool that cannot constrain",
        "/v1/chat/completions",
        {**CHAT, "tools": [BAD_TOOL], "tool_choice": "required"},
        "tools[0]",
    ),
    (
        "completions type",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "response_format": {"type": "x"}},
        "response_format.type",
    ),
    (
        "completions keyword",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "response_format": chat_schema({"if": {}, "then": {}})},
        "response_format.json_schema.schema",
    ),
    ("responses type", "/v1/responses", {**RESPONSES, "text": {"format": {"type": "xml"}}}, "text.format.type"),
    (
        "responses no schema",
        "/v1/responses",
        {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x"}}},
        "text.format.schema",
    ),
    (
        "responses keyword",
        "/v1/responses",
        {**RESPONSES, "text": text_schema({"type": "array", "uniqueItems": True})},
        "text.format.schema",
    ),
    ("responses $ref", "/v1/responses", {**RESPONSES, "text": text_schema({"$ref": "#/nope"})}, "text.format.schema"),
    (
        "responses named not a tool",
        "/v1/responses",
        {**RESPONSES, "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_time"}},
        "tool_choice",
    ),
    ("responses required, no tools", "/v1/responses", {**RESPONSES, "tool_choice": "required"}, "tool_choice"),
    (
        "responses choice in Chat's shape",
        "/v1/responses",
        {**RESPONSES, "tools": [RESPONSES_TOOL], "tool_choice": NAMED_CHAT},
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_constraint_that_cannot_be_honoured_is_a_400_naming_its_param(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]
    assert http.get("/health").status_code == 200


def test_the_openai_client_sees_a_refusal_as_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        )
    assert refused.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    assert "Unimplemented keys" in refused.value.body["message"]  # type: ignore[index]


def chat(
    client: openai.OpenAI,
    response_format: Any,
    *,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    top_logprobs: int | None = None,
) -> ChatCompletion:
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=response_format,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop=stop,
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs,
    )


# Seeds tried: a random-weight model closes its object within 64 tokens only now and then.
JSON_OBJECT_SEEDS = range(32)


def test_json_object_replies_that_finish_are_objects(client: openai.OpenAI) -> None:
    reasons = []
    with ThreadPoolExecutor(max_workers=len(JSON_OBJECT_SEEDS)) as pool:  # sent together: one batch decodes them
        completions = list(pool.map(lambda seed: chat(client, {"type": "json_object"}, seed=seed), JSON_OBJECT_SEEDS))
    for completion in completions:
        choice = completion.choices[0]
        content = choice.message.content or ""
        reasons.append(choice.finish_reason)
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(content), dict), content
        else:
            assert choice.finish_reason == "length"
            assert completion.usage is not None and completion.usage.completion_tokens == 64
            assert content.startswith("{")
    assert "stop" in reasons


def test_json_schema_replies_validate(client: openai.OpenAI) -> None:
    for seed in range(6):
        choice = chat(client, WEATHER_FORMAT, seed=seed).choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # a bounded schema ends
        jsonschema.validate(json.loads(choice.message.content or ""), WEATHER_SCHEMA)


def test_a_reply_cut_by_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    endless = {"type": "object", "properties": {"s": {"type": "string", "minLength": 500}}, "required": ["s"]}
    completion = chat(client, chat_schema(endless), max_tokens=8, seed=1)
    assert completion.choices[0].finish_reason == "length"
    assert (completion.choices[0].message.content or "").startswith('{"s": "')
    assert completion.usage is not None and completion.usage.completion_tokens == 8


def test_a_streamed_reply_is_the_same_constrained_reply(client: openai.OpenAI) -> None:
    for seed in range(3):
        whole = chat(client, WEATHER_FORMAT, seed=seed).choices[0]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=WEATHER_FORMAT,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            stream=True,
        )
        chunks = [chunk for chunk in stream if chunk.choices]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
        jsonschema.validate(json.loads(text), WEATHER_SCHEMA)
        assert text == whole.message.content


def test_logprobs_come_back_for_a_constrained_reply(client: openai.OpenAI) -> None:
    completion = chat(client, WEATHER_FORMAT, temperature=0, top_logprobs=2)
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_a_stop_string_still_cuts_a_constrained_reply(client: openai.OpenAI) -> None:
    full = chat(client, WEATHER_FORMAT, temperature=0).choices[0].message.content or ""
    assert ", " in full
    cut = chat(client, WEATHER_FORMAT, temperature=0, stop=[", "]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.index(", ")]


def test_completions_with_a_json_object_format(client: openai.OpenAI) -> None:
    def complete(seed: int) -> Completion:
        return client.completions.create(
            model=MODEL,
            prompt="A JSON object:",
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        )

    finished = 0
    with ThreadPoolExecutor(max_workers=len(JSON_OBJECT_SEEDS)) as pool:  # sent together: one batch decodes them
        completions = list(pool.map(complete, JSON_OBJECT_SEEDS))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
            finished += 1
    assert finished > 0


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def test_responses_text_format_is_followed_and_echoed(http: httpx.Client) -> None:
    text_format = {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    body = {"model": MODEL, "input": "The weather?", "text": {"format": text_format}, "max_output_tokens": 64}
    created = http.post("/v1/responses", json={**body, "temperature": 1.0})
    assert created.status_code == 200, created.text
    response = created.json()
    assert response["text"]["format"] == text_format
    assert response["status"] == "completed"  # a bounded schema ends
    jsonschema.validate(json.loads(output_text(response)), WEATHER_SCHEMA)
    stored = http.get(f"/v1/responses/{response['id']}").json()
    assert stored["text"]["format"] == text_format
    plain = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).json()
    assert plain["text"]["format"] == {"type": "text"}


def test_responses_text_format_through_the_openai_client(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input="The weather?",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}},
        max_output_tokens=64,
    )
    assert response.text is not None and response.text.format is not None
    shown = response.text.format.model_dump(by_alias=True, exclude_none=True)
    assert shown == {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER_SCHEMA)


def test_a_named_tool_choice_forces_a_valid_call(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[TOOL],
        tool_choice=NAMED_CHAT,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=1.0,
        seed=3,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert not choice.message.content


def test_required_tool_choice_in_responses_makes_a_function_call(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": "The weather in Lima?",
        "tools": [RESPONSES_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
    }
    response = http.post("/v1/responses", json=body).json()
    assert response["tool_choice"] == "required"
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), RESPONSES_TOOL["parameters"])
    assert output_text(response).strip() == ""


EXPECTED_CAPABILITIES = {
    "tool_calling": "generic",  # the tiny llama's template knows no tools
    "tool_choice": ["auto", "none", "required", "function"],
    "structured_outputs": ["text", "json_object", "json_schema"],
    "reasoning": None,  # its tokenizer has no reasoning markers
    "generation": True,
    "embeddings": None,  # no --embedding-pooling for it
}


def test_the_model_shows_its_capabilities(http: httpx.Client) -> None:
    model = http.get(f"/v1/models/{MODEL}").json()
    assert model["capabilities"] == EXPECTED_CAPABILITIES
    listed = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    health = http.get("/health").json()
    assert health["capabilities"] == EXPECTED_CAPABILITIES


def test_max_tool_calls_caps_the_calls_and_is_echoed(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "input": "The weather in Lima and Oslo?",
        "tools": [RESPONSES_TOOL],
        "tool_choice": "required",
        "max_tool_calls": 1,
        "max_output_tokens": 64,
    }
    response = http.post("/v1/responses", json=body).json()
    assert response["max_tool_calls"] == 1 and response["parallel_tool_calls"] is True
    assert [item["type"] for item in response["output"]] == ["function_call"]
    refused = http.post("/v1/responses", json=body | {"max_tool_calls": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tool_calls"
