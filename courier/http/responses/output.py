"""Generated text -> a response's output items: its reasoning, its visible text as it streams, tool calls once they
are complete."""

from __future__ import annotations

from collections.abc import Sequence

from courier.conversation.items import function_call_item, message_item, reasoning_item, text_part
from courier.core.tool_calls import ToolCall
from courier.engine.generation import TokenLogprob
from courier.http.reply import ReplyAssembler
from courier.storage.records import JsonObject


class OutputAssembler(ReplyAssembler):
    """A reply read as a response's items."""

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
        return item

    def output_items(
        self, calls: Sequence[ToolCall], message_id: str | None = None, reasoning_id: str | None = None
    ) -> list[JsonObject]:
        """The reasoning (if the model reasoned), the message (if it wrote text, or made no call), the calls."""
        items = [self.reasoning_item(reasoning_id)] if self.reasoning else []
        if self.text or not (calls or self.reasoning):
            items.append(self.message(message_id))
        return items + [function_call_item(call) for call in calls]

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
