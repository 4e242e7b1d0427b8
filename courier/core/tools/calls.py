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
from courier.grammar.constraint import ToolGrammar

ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallFormat:
    """How the served model marks tool calls, and the parser for what is between the marks.

    `mode` is "native" (the chat template's own format, parsed by mlx-lm) or "generic" (the template has none:
    `core/tools/generic.py` describes the tools and renders the history). `grammar` writes calls in this format
    for constrained decoding; None for a native format it cannot write (then only `tool_choice: "auto"` without
    `strict` functions is served).
    """

    start: str
    end: str
    parser: ToolParser
    mode: str = "native"
    grammar: ToolGrammar | None = None


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
    """Splits streamed text into content and the raw text of each call.

    Whitespace next to a call (the newlines a format puts around its markers) is held back: it becomes content
    only if content that is not whitespace follows it, so a reply that is only calls has no content at all. A
    format without an end marker (Mistral's `[TOOL_CALLS]`) holds everything after its start marker as one block.
    """

    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._buffer = ""
        self._inside = False
        self._pending = ""  # whitespace not yet known to be content
        self._called = False

    def feed(self, text: str) -> SplitText:
        self._buffer += text
        content: list[str] = []
        calls: list[str] = []
        while True:
            if self._inside and not self._end:  # a format without an end marker: the call runs to the end
                break
            marker = self._end if self._inside else self._start
            index = self._buffer.find(marker)
            if index < 0:
                break
            if self._inside:
                calls.append(self._buffer[:index])
                self._called = True
            else:
                content.append(self._content(self._buffer[:index]))
            self._buffer = self._buffer[index + len(marker) :]
            self._inside = not self._inside
        if not self._inside:
            keep = held_back_length(self._buffer, (self._start,))
            content.append(self._content(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]
        return SplitText("".join(content), tuple(calls))

    def finish(self, *, cut: bool = False) -> SplitText:
        """At the end of generation: an unclosed call is still offered to the parser. `cut`: the token limit ended
        the reply, so a start marker held back unfinished was a call it cut, never content (nor the whitespace
        before it)."""
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return SplitText("", (rest,))
        if cut and rest:  # what is held outside a call is always the start of the start marker
            self._pending = ""
            return SplitText("", ())
        text = self._content(rest)
        if not self._called:  # no call: trailing whitespace is the content's own
            text, self._pending = text + self._pending, ""
        return SplitText(text, ())

    def _content(self, text: str) -> str:
        """`text` with the whitespace held before it; its own trailing whitespace held in turn."""
        text = self._pending + text
        visible = text.rstrip()
        self._pending = text[len(visible) :]
        return visible


def parse_tool_call(text: str, parser: ToolParser, tools: Sequence[Mapping[str, Any]] | None) -> list[ToolCall]:
    """The tool calls in one call block, in OpenAI's shape (several for the formats that put parallel calls in
    one block: pythonic, Mistral, Gemma, Kimi, MiniMax); none when the text is not a valid call. A block in which
    one call does not parse yields the others."""
    try:
        parsed = parser(text, list(tools) if tools else None)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # the model's text is anything at all
        return []
    entries = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        arguments = entry.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=entry["name"], arguments=arguments))
    return calls


def parse_tool_calls(
    raw_calls: Sequence[str], tool_format: ToolCallFormat | None, tools: Sequence[Mapping[str, Any]] | None
) -> list[ToolCall]:
    """The valid tool calls among `raw_calls` (what a `ToolCallSplitter` found); none without a format."""
    if tool_format is None:
        return []
    return [call for raw in raw_calls for call in parse_tool_call(raw, tool_format.parser, tools)]


def json_arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """Tool-call arguments as chat templates expect them: a mapping when the JSON string holds one (within the depth
    limit of `core/json_text.py`), else the string as it came."""
    if isinstance(arguments, dict):
        return arguments
    parsed = json_object(arguments)
    return parsed if parsed is not None else arguments
