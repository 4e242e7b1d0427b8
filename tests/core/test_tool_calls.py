from __future__ import annotations

import json
from typing import Any

import pytest

from courier.core.tool_calls import ToolCallSplitter, parse_tool_call


def json_parser(text: str, tools: Any) -> Any:
    return json.loads(text.strip())


@pytest.mark.parametrize(
    ("pieces", "content", "calls"),
    [
        (["Hello there"], "Hello there", []),
        (['<tool_call>{"name": "f"}</tool_call>'], "", ['{"name": "f"}']),
        (["Sure. <tool", '_call>{"name":', ' "f"}</tool_', "call> done"], "Sure.  done", ['{"name": "f"}']),
        (["<tool_call>a</tool_call><tool_call>b</tool_call>"], "", ["a", "b"]),
        (["a <", "b"], "a <b", []),
        (["<tool_call>unclosed"], "", ["unclosed"]),
        # the newlines a format writes around and between calls are markup, not content
        (["<tool_call>\na\n</tool_call>\n<tool_call>\nb\n</tool_call>"], "", ["\na\n", "\nb\n"]),
        (["Hi\n", "<tool_call>a</tool_call>\n"], "Hi", ["a"]),
        (["Line one\n\n", "line two\n"], "Line one\n\nline two\n", []),
    ],
)
def test_splitter_separates_content_from_calls(pieces: list[str], content: str, calls: list[str]) -> None:
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    assert "".join(part.content for part in parts) == content
    assert [call for part in parts for call in part.calls] == calls


def test_parse_tool_call_returns_openai_shape() -> None:
    call = parse_tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}', json_parser, None)
    assert call is not None
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")


@pytest.mark.parametrize("text", ["not json", '{"arguments": {}}', "[1, 2]"])
def test_unparseable_calls_are_none(text: str) -> None:
    assert parse_tool_call(text, json_parser, None) is None
