"""How many calls a reply holds, through a real server, in a native tool format and in generic mode: a named
`tool_choice` is one call of that function, then the end (instructor's default); a reply that `max_tokens` cuts
inside a call keeps the calls before it, is marked cut, and no marker text leaks into its content (smolagents'
`required` with a small budget). Chat, streamed and not, and the Responses API, streamed and not.

Each model is kept from ending its reply where the grammar would let it go on (`logit_bias` -100 on its end of
sequence token), so a grammar that allowed a second call would get one, and every cut lands inside a call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support import tool_model
from tests.support.server import RunningServer, running_server

MODEL = "calls"
END_OF_SEQUENCE = {str(tool_model.EOS_TOKEN_ID): -100}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": tool_model.USER_QUESTION}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}
CHAT_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": TIME}},
]
RESPONSES_TOOLS: list[Any] = [{"type": "function", **tool["function"]} for tool in CHAT_TOOLS]
NAMED_CHAT: Any = {"type": "function", "function": {"name": "get_time"}}
NAMED_RESPONSES: Any = {"type": "function", "name": "get_time"}


@dataclass(frozen=True, slots=True)
class Served:
    server: RunningServer
    client: openai.OpenAI
    http: httpx.Client
    mode: str  # "native" or "generic", as the model reports its tool calling


@pytest.fixture(scope="module", params=["native", "generic"])
def served(
    request: pytest.FixtureRequest, tool_model_dir: Path, tiny_llama_dir: Path, cache_dir: Path
) -> Iterator[Served]:
    """The trained tool model (its template's own `<tool_call>` format) or the tiny llama (generic mode)."""
    model_dir = tool_model_dir if request.param == "native" else tiny_llama_dir
    args = ["--model", str(model_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server(args) as server, server.openai_client() as client, server.http() as http:
        yield Served(server, client, http, request.param)
        assert server.stop() == 0


def chat(served: Served, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": QUESTION, "tools": CHAT_TOOLS, "temperature": 0, **fields}
    return served.client.chat.completions.create(**body, extra_body={"logit_bias": END_OF_SEQUENCE})


def streamed_chat(served: Served, **fields: Any) -> tuple[str, list[dict[str, Any]], list[str]]:
    """The streamed reply's content, its calls (as complete objects) and its finish reasons."""
    chunks = [chunk for chunk in chat(served, stream=True, **fields) if chunk.choices]
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    calls = [
        {"name": call.function.name, "arguments": call.function.arguments}
        for chunk in chunks
        for call in chunk.choices[0].delta.tool_calls or []
        if call.function is not None
    ]
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason]
    return content, calls, finishes


def responses(served: Served, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "input": tool_model.USER_QUESTION, "tools": RESPONSES_TOOLS, "temperature": 0, **fields}
    answer = served.http.post("/v1/responses", json={**body, "logit_bias": END_OF_SEQUENCE})
    assert answer.status_code == 200, answer.text
    response: dict[str, Any] = answer.json()
    return response


def streamed_responses(served: Served, **fields: Any) -> dict[str, Any]:
    """The terminal event's response, with every text delta the stream sent checked against it."""
    body = {"model": MODEL, "input": tool_model.USER_QUESTION, "tools": RESPONSES_TOOLS, "temperature": 0, **fields}
    deltas: list[str] = []
    final: dict[str, Any] = {}
    with served.http.stream("POST", "/v1/responses", json={**body, "logit_bias": END_OF_SEQUENCE, "stream": True}) as s:
        for line in s.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "response.output_text.delta":
                deltas.append(event["delta"])
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    assert "".join(deltas) == output_text(final)
    return final


def output_text(response: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "") for item in response["output"] if item["type"] == "message" for part in item["content"]
    )


def function_calls(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for item in response["output"] if item["type"] == "function_call"]


def test_the_models_write_calls_in_the_format_under_test(served: Served) -> None:
    capabilities = served.http.get(f"/v1/models/{MODEL}").json()["capabilities"]
    assert capabilities["tool_calling"] == served.mode


def test_a_named_choice_is_one_call_then_the_end(served: Served) -> None:
    reply = chat(served, tool_choice=NAMED_CHAT, max_tokens=96)  # parallel_tool_calls: true, as instructor sends
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_time"]
    assert json.loads(calls[0].function.arguments)["zone"] in ("CET", "UTC")
    assert not choice.message.content
    content, streamed, finishes = streamed_chat(served, tool_choice=NAMED_CHAT, max_tokens=96)
    assert (content, finishes) == ("", ["tool_calls"])
    assert streamed == [{"name": "get_time", "arguments": calls[0].function.arguments}]


def test_a_named_choice_is_one_function_call_item_in_responses(served: Served) -> None:
    for response in (
        responses(served, tool_choice=NAMED_RESPONSES, max_output_tokens=96),
        streamed_responses(served, tool_choice=NAMED_RESPONSES, max_output_tokens=96),
    ):
        assert response["status"] == "completed", response
        assert [item["type"] for item in response["output"]] == ["function_call"]
        assert [call["name"] for call in function_calls(response)] == ["get_time"]


def budgets(served: Served) -> range:
    """Every `max_tokens` from a cut in the first call's marker to a few tokens into the second's."""
    whole = chat(served, tool_choice="required", parallel_tool_calls=False, max_tokens=96)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.usage is not None
    one_call = whole.usage.completion_tokens  # the call and the end of sequence token
    return range(2, one_call + 8)


def test_a_required_reply_cut_inside_a_call_keeps_the_calls_before_it_and_leaks_no_marker(served: Served) -> None:
    seen_whole_calls = False
    for max_tokens in budgets(served):
        choice = chat(served, tool_choice="required", max_tokens=max_tokens).choices[0]
        assert choice.finish_reason == "length", (max_tokens, choice)
        assert not choice.message.content, (max_tokens, choice.message.content)
        calls = choice.message.tool_calls or []
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)
        seen_whole_calls = seen_whole_calls or bool(calls)
        content, streamed, finishes = streamed_chat(served, tool_choice="required", max_tokens=max_tokens)
        assert (content, finishes) == ("", ["length"]), max_tokens
        assert [call["name"] for call in streamed] == [call.function.name for call in calls]
    assert seen_whole_calls  # the budgets reach past the first call


def test_a_responses_reply_cut_inside_a_call_is_incomplete_with_the_calls_before_it(served: Served) -> None:
    for max_tokens in budgets(served)[-8:]:  # cut in the second call: its marker, then its body
        for response in (
            responses(served, tool_choice="required", max_output_tokens=max_tokens),
            streamed_responses(served, tool_choice="required", max_output_tokens=max_tokens),
        ):
            assert response["status"] == "incomplete", (max_tokens, response)
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            assert output_text(response) == "", (max_tokens, response["output"])
            assert not any(marker in json.dumps(response["output"]) for marker in ("<tool", "\\n<"))
            assert [item["type"] for item in response["output"]] == ["function_call"]
