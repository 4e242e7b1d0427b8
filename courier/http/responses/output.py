"""Generated text -> a response's output items: its reasoning, its visible text as it streams, tool calls once they
are complete.

The reasoning item carries its text as `reasoning_text` content; with `reasoning.summary` asked for, as a
`summary_text` part too (the text itself: the model's reasoning is not secret here, so its summary is the whole of
it); with `include: ["reasoning.encrypted_content"]`, sealed in `encrypted_content` (`conversation/sealed.py`).
Calls come back as the item their tool's type defines (`tools.py`): `function_call` (with its `namespace`) or
`custom_tool_call`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from courier.conversation.items import message_item, reasoning_item, text_part
from courier.conversation.sealed import ReasoningSeal
from courier.core.tools.calls import ToolCall
from courier.engine.generation import TokenLogprob
from courier.http.reply import ReplyAssembler, ReplyParsing
from courier.http.responses.tools import ResponsesTools
from courier.storage.records import JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemShapes:
    """What a request asks of its output items beyond the text: its tools' call items, summaries, seals."""

    tools: ResponsesTools = field(default_factory=ResponsesTools)
    summary: bool = False
    seal: ReasoningSeal | None = None


class OutputAssembler(ReplyAssembler):
    """A reply read as a response's items."""

    def __init__(self, parsing: ReplyParsing, shapes: ItemShapes | None = None) -> None:
        super().__init__(parsing)
        self.shapes = shapes or ItemShapes()
        self._sealed: tuple[str, str] | None = None  # the reasoning last sealed, and its seal

    @property
    def text(self) -> str:
        return self.content

    def message(self, message_id: str | None = None, status: str = "completed") -> JsonObject:
        logprobs = logprob_objects(self.logprobs)
        item = message_item("assistant", [text_part("output_text", self.text, logprobs)], status)
        if message_id is not None:
            item["id"] = message_id
        return item

    def reasoning_item(self, item_id: str | None = None, status: str = "completed") -> JsonObject:
        item = reasoning_item(self.reasoning, status)
        if item_id is not None:
            item["id"] = item_id
        if self.shapes.summary:
            item["summary"] = [{"type": "summary_text", "text": self.reasoning}]
        if self.shapes.seal is not None:
            item["encrypted_content"] = self._seal(self.shapes.seal)
        return item

    def _seal(self, seal: ReasoningSeal) -> str:
        """The reasoning sealed once (each seal takes a fresh nonce): the item a stream's `.done` event carries and
        the one in the response's output are the same, to the byte."""
        if self._sealed is None or self._sealed[0] != self.reasoning:
            self._sealed = (self.reasoning, seal.seal(self.reasoning))
        return self._sealed[1]

    def output_items(
        self, calls: Sequence[ToolCall], message_id: str | None = None, reasoning_id: str | None = None
    ) -> list[JsonObject]:
        """The reasoning (if the model reasoned), the message (if it wrote text, or made no call), the calls."""
        items = [self.reasoning_item(reasoning_id)] if self.reasoning else []
        if self.text or not (calls or self.reasoning):
            items.append(self.message(message_id))
        return items + [self.shapes.tools.call_item(call) for call in calls]

    def partial(self) -> list[JsonObject]:
        """What a cancelled or failed generation leaves: its reasoning and text so far, marked incomplete."""
        status = "completed" if self.reasoning_closed else "incomplete"
        items = [self.reasoning_item(status=status)] if self.reasoning else []
        return items + ([self.message(status="incomplete")] if self.text else [])


def logprob_objects(entries: Sequence[TokenLogprob]) -> list[JsonObject]:
    """`output_text` logprobs: one per token, each with its top alternatives."""

    def entry(token: str, logprob: float) -> JsonObject:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return [
        {**entry(item.token, item.logprob), "top_logprobs": [entry(text, lp) for _, text, lp in item.top]}
        for item in entries
    ]
