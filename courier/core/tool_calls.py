"""Separating tool calls from content in generated text, and parsing them.

Tool calls sit between the chat template's markers (for example `<tool_call>` and
`</tool_call>`). While text streams, everything outside the markers is content
and can be sent at once; text inside is held until the call closes, then parsed
by the model family's parser from mlx-lm. A marker split across two deltas is
held back until it is known whether it is one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from courier.core.json_text import json_object
from courier.core.stop_text import held_back_length

ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFormat:
    """How the served model marks tool calls, and mlx-lm's parser for what is between the marks."""

    start: str
    end: str
    parser: ToolParser


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class SplitText:
    content: str
    calls: tuple[str, ...]


class ToolCallSplitter:
    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> SplitText:
        self._buffer += text
        content: list[str] = []
        calls: list[str] = []
        while True:
            marker = self._end if self._inside else self._start
            index = self._buffer.find(marker)
            if index < 0:
                break
            if self._inside:
                calls.append(self._buffer[:index])
            else:
                content.append(self._buffer[:index])
            self._buffer = self._buffer[index + len(marker) :]
            self._inside = not self._inside
        if not self._inside:
            keep = held_back_length(self._buffer, (self._start,))
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
        return SplitText("".join(content), tuple(calls))

    def finish(self) -> SplitText:
        """At the end of generation: an unclosed call is still offered to the parser."""
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return SplitText("", (rest,))
        return SplitText(rest, ())


def parse_tool_call(text: str, parser: ToolParser, tools: Sequence[Mapping[str, Any]] | None) -> ToolCall | None:
    """One tool call in OpenAI's shape, or None when the text is not a valid call."""
    try:
        parsed = parser(text, list(tools) if tools else None)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # the model's text is anything at all
        return None
    if isinstance(parsed, list):
        parsed = parsed[0] if len(parsed) == 1 else None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=parsed["name"], arguments=arguments)


def parse_tool_calls(
    raw_calls: Sequence[str], tool_format: ToolCallFormat | None, tools: Sequence[Mapping[str, Any]] | None
) -> list[ToolCall]:
    """The valid tool calls among `raw_calls` (what a `ToolCallSplitter` found); none without a format."""
    if tool_format is None:
        return []
    parsed = (parse_tool_call(raw, tool_format.parser, tools) for raw in raw_calls)
    return [call for call in parsed if call is not None]


def json_arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """Tool-call arguments as chat templates expect them: a mapping when the JSON string holds one (within the depth
    limit of `core/json_text.py`), else the string as it came."""
    if isinstance(arguments, dict):
        return arguments
    parsed = json_object(arguments)
    return parsed if parsed is not None else arguments
