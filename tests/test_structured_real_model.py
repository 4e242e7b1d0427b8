"""Structured outputs and tool calls on the embedded SmolLM2, end to end through the official openai client.

SmolLM2's chat template knows no tools, so its tools are served in generic mode (`core/tools/generic.py`): these
tests are also the tool loop a user of the default model runs first.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.server import RunningServer

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "calm"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["mood", "score"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -999, "maximum": 999}, {"type": "boolean"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "$ref": {
        "type": "object",
        "$defs": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}},
                "required": ["name"],
                "additionalProperties": False,
            }
        },
        "properties": {"home": {"$ref": "#/$defs/city"}, "work": {"$ref": "#/$defs/city"}},
        "required": ["home", "work"],
        "additionalProperties": False,
    },
    "required subset": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER,
        "strict": True,
    },
}
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER,
    "strict": True,
}
QUESTION = "What is the weather in Paris?"


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared default SmolLM2 server (tests/conftest.py)


def structured(
    client: openai.OpenAI, name: str, schema: dict[str, Any], max_tokens: int = 160
) -> tuple[str | None, str]:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Reply with JSON ({name})."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        temperature=1.0,
        max_tokens=max_tokens,
    )
    choice = reply.choices[0]
    return choice.message.content, choice.finish_reason


def test_every_completed_output_validates_against_its_schema_at_temperature_one(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(max_workers=len(SCHEMAS)) as pool:
        replies = dict(zip(SCHEMAS, pool.map(lambda item: structured(client, *item), SCHEMAS.items()), strict=True))
    completed = {name: text for name, (text, finish) in replies.items() if finish == "stop"}
    assert len(completed) >= len(SCHEMAS) - 1, replies  # a reply may be cut by max_tokens; almost none are
    for name, text in completed.items():
        assert text is not None
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_mode_answers_with_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the country of Paris as JSON, one key."}],
        response_format={"type": "json_object"},
        temperature=0.2,
        max_tokens=120,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: it still began as an object
        assert (reply.choices[0].message.content or "").startswith("{")


def test_the_sdk_parse_helpers_return_the_model_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Tell me about Rome: its name and country, in JSON."}]
    whole = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, temperature=0.2, max_tokens=80
    )
    assert isinstance(whole.choices[0].message.parsed, City)
    with client.chat.completions.stream(
        model=MODEL, messages=messages, response_format=City, temperature=0.2, max_tokens=80
    ) as stream:
        streamed = stream.get_final_completion()
    assert isinstance(streamed.choices[0].message.parsed, City)
    response = client.responses.parse(
        model=MODEL, input="Tell me about Berlin.", text_format=City, temperature=0.2, max_output_tokens=80
    )
    assert isinstance(response.output_parsed, City)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    with client.responses.stream(
        model=MODEL, input="Tell me about Madrid.", text_format=City, temperature=0.2, max_output_tokens=80
    ) as responses_stream:
        final = responses_stream.get_final_response()
    assert isinstance(final.output_parsed, City)


def test_a_forced_call_then_its_result_then_an_answer_through_chat(client: openai.OpenAI) -> None:
    question: Any = [{"role": "user", "content": QUESTION}]
    forced = client.chat.completions.create(
        model=MODEL,
        messages=question,
        tools=[CHAT_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # else the model may go on calling until max_tokens cuts it ("length")
        temperature=1.0,
        max_tokens=80,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(call.type == "function" and call.function.name == "get_weather" for call in calls)
    for call in calls:
        assert call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    reply: Any = choice.message.model_dump(exclude_none=True)
    results: Any = [{"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"} for call in calls]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[*question, reply, *results],
        tools=[CHAT_TOOL],
        temperature=0,
        max_tokens=30,
    )
    assert answer.choices[0].message.content


def test_a_named_function_and_no_parallel_calls_give_exactly_that_one_call(client: openai.OpenAI) -> None:
    other: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[other, CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=1.0,
        max_tokens=80,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == "get_weather"


def test_the_tool_loop_through_responses_and_a_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and [item.type for item in first.output] == ["function_call"] * len(calls)
    outputs: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"} for call in calls]
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=outputs, tools=[RESPONSES_TOOL], max_output_tokens=30
    )
    assert second.status in ("completed", "incomplete") and second.output_text
    conversation = client.conversations.create()
    named = client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        input=QUESTION,
        tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    (call,) = [item for item in named.output if item.type == "function_call"]
    assert getattr(named.tool_choice, "name", None) == "get_weather"
    then = client.responses.create(
        model=MODEL,
        conversation=conversation.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}],
        tools=[RESPONSES_TOOL],
        max_output_tokens=30,
    )
    assert then.output_text


def grammar_metrics(http: httpx.Client) -> dict[str, float]:
    return {
        line.split()[0]: float(line.split()[1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith("courier_grammar_")
    }


def test_the_model_and_health_say_tools_are_generic_and_metrics_count_grammars(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    model = http.get(f"/v1/models/{MODEL}").json()
    assert model["capabilities"]["tool_calling"] == "generic"
    # The embedded model samples as its card recommends when a request sends no temperature or top_p.
    assert model["sampling_defaults"] == {"temperature": 0.2, "top_p": 0.9, "source": "model card", "max_tokens": 4096}
    assert "required" in model["capabilities"]["tool_choice"]
    assert http.get("/health").json()["capabilities"] == model["capabilities"]
    # The server is shared with other modules: what one schema of this test's own adds, twice.
    schema = {**SCHEMAS["enum"], "title": f"grammar-metrics-{id(http)}"}  # a schema no other request sent
    before = grammar_metrics(http)
    # The grammar is compiled before admission: a few tokens of the reply are enough.
    structured(client, "first", schema, max_tokens=4)
    once = grammar_metrics(http)
    structured(client, "again", schema, max_tokens=4)
    twice = grammar_metrics(http)
    # Compiled once (before admission; the engine is handed the compiled grammar), then served from the cache.
    assert once["courier_grammar_compiles_total"] == before["courier_grammar_compiles_total"] + 1
    assert twice["courier_grammar_compiles_total"] == once["courier_grammar_compiles_total"]
    assert twice["courier_grammar_cache_hits_total"] >= once["courier_grammar_cache_hits_total"] + 1
    assert 0 < twice["courier_grammar_cache_entries"] <= 256
    # Built once too: the second request's spec found its grammar built (no schema checked or grammar made again).
    assert twice["courier_grammar_built_hits_total"] >= once["courier_grammar_built_hits_total"] + 1
    assert 0 < twice["courier_grammar_built_entries"] <= 256
