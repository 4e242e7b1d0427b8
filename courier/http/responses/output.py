"""Generated text -> a response's output items: visible text as it streams, tool calls once they are complete."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from courier.conversation.items import function_call_item, message_item, text_part
from courier.core.tool_calls import ToolCall, ToolCallFormat, ToolCallSplitter, parse_tool_calls
from courier.engine.generation import TokenLogprob, TokensGenerated
from courier.grammar.output_spec import OutputSpec
from courier.storage.records import JsonObject


class OutputAssembler:
    def __init__(
        self, tool_format: ToolCallFormat | None, tools: Sequence[Mapping[str, Any]] | None, output: OutputSpec
    ) -> None:
        self._format = tool_format if tools else None
        self._output = output  # parallel_tool_calls, max_tool_calls: enforced here where no grammar did
        self._tools = tools
        self._splitter = ToolCallSplitter(self._format.start, self._format.end) if self._format else None
        self._raw_calls: list[str] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def text(self) -> str:
        return "".join(self._text)

    def feed(self, event: TokensGenerated) -> str:
        """The visible text this event adds (tool-call markup held back)."""
        text = event.text
        if self._splitter is not None:
            split = self._splitter.feed(text)
            self._raw_calls.extend(split.calls)
            text = split.content
        self._text.append(text)
        self._logprobs.extend(event.logprobs)
        return text

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Text still held back, and the complete tool calls."""
        rest = ""
        if self._splitter is not None:
            split = self._splitter.finish()
            self._raw_calls.extend(split.calls)
            rest = split.content
            self._text.append(rest)
        calls = parse_tool_calls(self._raw_calls, self._format, self._tools)
        return rest, self._output.kept_calls(calls)

    def message(self, message_id: str | None = None, status: str = "completed") -> JsonObject:
        item = message_item("assistant", [text_part("output_text", self.text, logprob_objects(self._logprobs))], status)
        if message_id is not None:
            item["id"] = message_id
        return item

    def output_items(self, calls: Sequence[ToolCall], message_id: str | None = None) -> list[JsonObject]:
        items = [self.message(message_id)] if self.text or not calls else []
        return items + [function_call_item(call) for call in calls]


def logprob_objects(entries: Sequence[TokenLogprob]) -> list[JsonObject]:
    """`output_text` logprobs: one per token, each with its top alternatives."""

    def entry(token: str, logprob: float) -> JsonObject:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {**entry(item.token, item.logprob), "top_logprobs": [entry(text, lp) for _, text, lp in item.top]}
        for item in entries
    ]
