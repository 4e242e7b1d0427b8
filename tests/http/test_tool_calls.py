"""A tool-call round trip through the real server, on a tiny model trained to call `get_weather`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.support import tool_model
from tests.support.server import RunningServer, serving

MODEL = "tool-model"
TOOLS: list[ChatCompletionToolParam] = [tool_model.TOOL]  # type: ignore[list-item]
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": tool_model.USER_QUESTION}]


@pytest.fixture(scope="module")
def server(tool_model_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(tool_model_dir, cache_dir, MODEL) as running:
        yield running


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == tool_model.TOOL_NAME
    assert json.loads(call.function.arguments) == tool_model.TOOL_ARGUMENTS
    assert call.id.startswith("call_")

    assistant: dict[str, Any] = choice.message.model_dump(exclude_none=True)
    tool_result: ChatCompletionMessageParam = {
        "role": "tool",
        "tool_call_id": call.id,
        "content": tool_model.TOOL_RESULT,
    }
    second = client.chat.completions.create(
        model=MODEL,
        messages=[*QUESTION, assistant, tool_result],  # type: ignore[list-item]
        tools=TOOLS,
        temperature=0,
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == tool_model.FINAL_ANSWER
    assert second.choices[0].message.tool_calls is None


def test_streamed_tool_call_arrives_as_a_tool_calls_delta(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, stream=True)
    chunks = [chunk for chunk in stream if chunk.choices]
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert "<tool_call>" not in content and content.strip() == ""
    assert len(calls) == 1
    assert calls[0].function is not None and calls[0].function.name == tool_model.TOOL_NAME
    assert json.loads(calls[0].function.arguments or "") == tool_model.TOOL_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_keeps_tools_out_of_the_prompt(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, temperature=0)
    none = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0
    )
    with_tools = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert none.usage is not None and plain.usage is not None and with_tools.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


RESPONSES_TOOLS: list[Any] = [{"type": "function", **tool_model.TOOL["function"]}]


def test_responses_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=tool_model.USER_QUESTION, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64
    )
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == tool_model.TOOL_NAME
    assert json.loads(call.arguments) == tool_model.TOOL_ARGUMENTS
    assert call.call_id.startswith("call_")

    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": tool_model.TOOL_RESULT}],
        tools=RESPONSES_TOOLS,
        temperature=0,
        max_output_tokens=64,
    )
    assert second.status == "completed"
    assert second.output_text == tool_model.FINAL_ANSWER
    assert [item.type for item in second.output] == ["message"]


def test_responses_stream_function_call_events(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=tool_model.USER_QUESTION, tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    arguments = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert len(arguments) == 1
    assert json.loads(arguments[0].arguments) == tool_model.TOOL_ARGUMENTS
    assert "response.function_call_arguments.delta" in kinds
    calls = [item for item in final.output if item.type == "function_call"]
    assert [call.name for call in calls] == [tool_model.TOOL_NAME]


GREETING: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello! How are you today?"}]
TIME_TOOL: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TIME_RESPONSES_TOOL: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}
STRICT_TOOL: Any = {"type": "function", "function": {**tool_model.TOOL["function"], "parameters": CITY, "strict": True}}


def test_required_always_makes_a_valid_call_even_at_temperature_one(client: openai.OpenAI) -> None:
    for _ in range(3):
        forced = client.chat.completions.create(
            model=MODEL,
            messages=GREETING,
            tools=[STRICT_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,  # one call, then the end: nothing left for max_tokens to cut
            temperature=1.0,
            max_tokens=96,
        )
        choice = forced.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        for call in calls:
            assert call.type == "function" and call.function.name == tool_model.TOOL_NAME
            arguments = json.loads(call.function.arguments)  # strict: valid against the parameters
            assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_a_named_function_is_the_one_called_once(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=[*TOOLS, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1
    assert calls[0].type == "function" and calls[0].function.name == "get_time"
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    responses = client.responses.create(
        model=MODEL,
        input=tool_model.USER_QUESTION,
        tools=[*RESPONSES_TOOLS, TIME_RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=0,
        max_output_tokens=96,
    )
    assert [(item.type, getattr(item, "name", None)) for item in responses.output] == [("function_call", "get_time")]


def test_auto_with_a_strict_function_leaves_the_trained_call_as_it_was(client: openai.OpenAI) -> None:
    trained: Any = {"type": "function", "function": {**tool_model.TOOL["function"], "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[trained], temperature=0)
    calls = reply.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert json.loads(calls[0].function.arguments) == tool_model.TOOL_ARGUMENTS


def test_the_model_says_its_tools_are_native(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    capabilities = (model.model_extra or {})["capabilities"]
    assert capabilities["tool_calling"] == "native"
    assert capabilities["tool_choice"] == ["auto", "none", "required", "function"]
