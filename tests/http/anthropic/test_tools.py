"""A tool loop on the Messages API with a model whose template has tools of its own (native `json_tools`), trained to
call `get_weather` and then answer from its result (tests/support/tool_model.py): every tool_choice, the tool_result
turn, and a stop sequence reported as such.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.support import tool_model
from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer, serving

if TYPE_CHECKING:
    import anthropic
else:
    anthropic = lazily("anthropic")  # tests/support/lazy_modules.py: not at collection

MODEL = "tool-model"
TOOL: Any = {
    "name": tool_model.TOOL_NAME,
    "description": tool_model.TOOL["function"]["description"],
    "input_schema": tool_model.TOOL["function"]["parameters"],
}
QUESTION: Any = [{"role": "user", "content": tool_model.USER_QUESTION}]


@pytest.fixture(scope="module")
def tools_server(
    smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    model_dir = tool_model.build_tool_model(smollm2_dir, tmp_path_factory.mktemp("tool-model-anthropic"))
    with serving(model_dir, cache_dir, MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def claude(tools_server: RunningServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=tools_server.base_url, api_key="unused", max_retries=0) as client:
        yield client


def create(client: anthropic.Anthropic, messages: Any, **fields: Any) -> Any:
    return client.messages.create(
        model=MODEL, max_tokens=80, messages=messages, tools=[TOOL], extra_body={"temperature": 0}, **fields
    )


@pytest.mark.parametrize(
    "choice",
    [None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": tool_model.TOOL_NAME}],
    ids=["default", "auto", "any", "tool"],
)
def test_the_model_calls_its_tool(claude: anthropic.Anthropic, choice: Any) -> None:
    message = create(claude, QUESTION, **({"tool_choice": choice} if choice else {}))
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert (call.type, call.name, call.input) == ("tool_use", tool_model.TOOL_NAME, tool_model.TOOL_ARGUMENTS)
    assert call.id.startswith("toolu_")


def test_tool_choice_none_keeps_the_tools_out(claude: anthropic.Anthropic) -> None:
    message = create(claude, QUESTION, tool_choice={"type": "none"})
    assert all(block.type == "text" for block in message.content)
    counted = claude.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[TOOL], tool_choice={"type": "none"})
    assert counted.input_tokens == claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens


def test_the_tool_result_turn_gets_the_answer(claude: anthropic.Anthropic) -> None:
    first = create(claude, QUESTION)
    (call,) = first.content
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": tool_model.TOOL_RESULT}],
        },
    ]
    second = create(claude, history)
    assert second.stop_reason == "end_turn"
    assert [block.text for block in second.content] == [tool_model.FINAL_ANSWER]
    counted = claude.messages.count_tokens(model=MODEL, messages=history, tools=[TOOL]).input_tokens
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted


def test_the_same_turn_streamed(claude: anthropic.Anthropic) -> None:
    first = create(claude, QUESTION)
    results = [
        {
            "type": "tool_result",
            "tool_use_id": first.content[0].id,
            "content": [{"type": "text", "text": tool_model.TOOL_RESULT}],
        }
    ]
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    with claude.messages.stream(
        model=MODEL, max_tokens=80, messages=history, tools=[TOOL], extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == tool_model.FINAL_ANSWER
        assert stream.get_final_message().stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_is_reported(claude: anthropic.Anthropic, stream: bool) -> None:
    first = create(claude, QUESTION)
    results = [{"type": "tool_result", "tool_use_id": first.content[0].id, "content": tool_model.TOOL_RESULT}]
    history: list[Any] = [
        *QUESTION,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    fields: Any = {"model": MODEL, "max_tokens": 80, "messages": history, "tools": [TOOL]}
    fields |= {"stop_sequences": ["sunny", "never"], "extra_body": {"temperature": 0}}
    message: Any
    if stream:
        with claude.messages.stream(**fields) as streamed:
            message = streamed.get_final_message()
    else:
        message = claude.messages.create(**fields)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "sunny")
    assert [block.text for block in message.content] == [tool_model.FINAL_ANSWER.split("sunny")[0]]
