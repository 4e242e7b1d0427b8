from __future__ import annotations

import json
from typing import Any

import pytest

from courier.core.tools.calls import ToolCallFormat, ToolCallSplitter, parse_tool_call, parse_tool_calls


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


@pytest.mark.parametrize(
    ("pieces", "content", "calls"),
    [
        # A further call cut in its start marker: the complete call is kept, the marker and the newline dropped.
        (["<tool_call>a</tool_call>", "\n<tool"], "", ["a"]),
        (["Sure. <tool_"], "Sure.", []),
        (["Sure. <"], "Sure.", []),
        # Cut inside a call: offered to the parser (which refuses half a call), never content.
        (['<tool_call>a</tool_call>\n<tool_call>\n{"na'], "", ["a", '\n{"na']),
        (["Plain text cut short "], "Plain text cut short ", []),
    ],
)
def test_a_cut_call_never_becomes_content(pieces: list[str], content: str, calls: list[str]) -> None:
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish(cut=True)]
    assert "".join(part.content for part in parts) == content
    assert [call for part in parts for call in part.calls] == calls


def test_a_held_marker_start_is_content_when_the_reply_was_not_cut() -> None:
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>")
    parts = [splitter.feed("Use <tool"), splitter.finish()]
    assert "".join(part.content for part in parts) == "Use <tool"


def test_parse_tool_call_returns_openai_shape() -> None:
    (call,) = parse_tool_call('{"name": "get_weather", "arguments": {"city": "Paris"}}', json_parser, None)
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")


@pytest.mark.parametrize("text", ["not json", '{"arguments": {}}', "[1, 2]"])
def test_unparseable_calls_are_none(text: str) -> None:
    assert parse_tool_call(text, json_parser, None) == []


def test_every_call_of_a_block_holding_several_is_kept() -> None:
    block = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}, {"oops": 1}]'
    calls = parse_tool_call(block, json_parser, None)
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("a", {}), ("b", {"x": 1})]
    assert len({call.id for call in calls}) == 2


def test_mistral_calls_without_an_end_marker_are_all_parsed() -> None:
    from mlx_lm.tool_parsers import mistral

    form = ToolCallFormat(start=mistral.tool_call_start, end=mistral.tool_call_end, parser=mistral.parse_tool_call)
    assert form.end == ""
    splitter = ToolCallSplitter(form.start, form.end)
    text = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    parts = [splitter.feed(text), splitter.feed('{"name": "get_time", "arguments": {"zone": "CET"}}]')]
    parts.append(splitter.finish())
    assert "".join(part.content for part in parts) == "Sure."
    calls = parse_tool_calls([raw for part in parts for raw in part.calls], form, None)
    assert [call.name for call in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"zone": "CET"}
