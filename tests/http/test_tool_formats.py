"""Parallel calls in other families' formats, through the real server with the official client.

Tiny models trained to answer one question with two `get_weather` calls, in Mistral's format (no end marker,
calls one after another) and LFM2's pythonic one (both calls in one block): every call is kept, and
`parallel_tool_calls: false` (chat) or `max_tool_calls: 1` (Responses) keeps the first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support import tool_format_models
from tests.support.server import RunningServer, running_server
from tests.support.tool_format_models import CITIES, QUESTION
from tests.support.tool_model import TOOL

FLAT_TOOL: dict[str, Any] = {"type": "function", **TOOL["function"]}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for every family's model, each served under its family's name."""
    declared: list[str] = []
    for family in sorted(tool_format_models.FORMATS):
        model_dir = tool_format_models.build_tool_format_model(smollm2_dir, tmp_path_factory.mktemp(family), family)
        declared += ["--model", f"{family}={model_dir}"]
    with running_server([*declared, "--cache-dir", str(cache_dir)]) as running:
        yield running
        assert running.stop() == 0


@pytest.fixture(scope="module", params=sorted(tool_format_models.FORMATS))
def model(request: pytest.FixtureRequest, server: RunningServer) -> str:
    """The family under test: the name its model is served as."""
    return str(request.param)


def _cities(calls: list[Any]) -> list[str]:
    return [json.loads(call.function.arguments)["city"] for call in calls]


def test_every_call_of_the_reply_is_kept(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],  # type: ignore[list-item]
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_weather", "get_weather"]  # type: ignore[union-attr]
    assert _cities(calls) == list(CITIES)
    assert len({call.id for call in calls}) == 2


def test_streamed_calls_are_all_kept(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],  # type: ignore[list-item]
        temperature=0,
        stream=True,
    )
    assert isinstance(stream, openai.Stream)
    calls: list[Any] = []
    content = ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls.extend(choice.delta.tool_calls or [])
    assert content == ""  # the call markup is never streamed as text
    assert [call.index for call in calls] == [0, 1]
    assert _cities(calls) == list(CITIES)


def test_parallel_tool_calls_false_keeps_the_first(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],  # type: ignore[list-item]
        temperature=0,
        parallel_tool_calls=False,
    )
    assert _cities(reply.choices[0].message.tool_calls or []) == [CITIES[0]]


def test_responses_keep_every_call_and_honour_max_tool_calls(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(model=model, input=QUESTION, tools=[FLAT_TOOL], temperature=0)  # type: ignore[list-item]
    calls = [item for item in response.output if item.type == "function_call"]
    assert [json.loads(call.arguments)["city"] for call in calls] == list(CITIES)
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    capped = client.responses.create(
        model=model,
        input=QUESTION,
        tools=[FLAT_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tool_calls=1,
    )
    kept = [item for item in capped.output if item.type == "function_call"]
    assert [json.loads(call.arguments)["city"] for call in kept] == [CITIES[0]]
    assert capped.max_tool_calls == 1
