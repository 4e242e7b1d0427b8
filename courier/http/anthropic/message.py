"""The Messages API's reply shapes: the message object, its content blocks, `stop_reason` and `usage`.

Usage splits the prompt in two: `cache_read_input_tokens` (what the snapshot store served, its `cached_tokens`) and
`input_tokens` (the rest, prefilled), which add up to the prompt `count_tokens` reports. `cache_creation_input_tokens`
is always 0. The snapshot store keeps every prompt by itself (no `cache_control` breakpoint asks for it), and a stream's
`message_start` is sent before the split is known. Claude Code merges a stream's usage field by field, and a later
figure replaces an earlier one only when it is above 0. If writes counted as cache creation, `input_tokens` would
fall to 0 in `message_delta`, and Claude Code would count the prompt twice: once as the start's `input_tokens`, once
as the delta's cache creation. A prompt's last token is always prefilled, so the delta's `input_tokens` is at least 1.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from courier.core.json_text import json_object
from courier.core.tools.calls import ToolCall
from courier.storage.records import JsonObject

TOOL_USE_PREFIX = "toolu_"


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    thinking_tokens: int = 0

    def as_dict(self) -> JsonObject:
        cached = max(0, min(self.cached_tokens, self.prompt_tokens - 1))  # its last token is always prefilled
        return {
            "input_tokens": self.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"thinking_tokens": self.thinking_tokens},
            "service_tier": "standard",
        }


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(*, cut: bool, calls: Sequence[ToolCall], stop_sequence: str | None, window_capped: bool = False) -> str:
    """`max_tokens` whenever the limit cut the reply (a call may have been cut with it), as chat says `length`;
    `model_context_window_exceeded` when that limit was the context window's, lower than the request's `max_tokens`
    (Claude Code then says the window was reached, not that the reply outgrew its output maximum)."""
    if cut:
        return "model_context_window_exceeded" if window_capped else "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def thinking_block(thinking: str) -> JsonObject:
    # Nothing here signs reasoning: a client sends the block back as it came, and it is rendered as it says.
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def text_block(text: str) -> JsonObject:
    return {"type": "text", "text": text}


def tool_use_block(call: ToolCall) -> JsonObject:
    """A call as a `tool_use` block: its arguments as the `input` object ({} when they are not a JSON object)."""
    call_id = call.id if call.id.startswith(TOOL_USE_PREFIX) else TOOL_USE_PREFIX + call.id.removeprefix("call_")
    return {"type": "tool_use", "id": call_id, "name": call.name, "input": json_object(call.arguments) or {}}


def content_blocks(
    reasoning: str, text: str, calls: Sequence[ToolCall], *, thinking_shown: bool = True
) -> list[JsonObject]:
    """Thinking first (its text empty unless `thinking_shown`), then the text (none when it is only whitespace), then
    each call."""
    blocks = [thinking_block(reasoning if thinking_shown else "")] if reasoning else []
    if text.strip():
        blocks.append(text_block(text))
    return [*blocks, *(tool_use_block(call) for call in calls)]


def message_object(
    *,
    message_id: str,
    model: str,
    content: Sequence[JsonObject],
    stop: str | None,
    stop_sequence: str | None,
    usage: Usage,
) -> JsonObject:
    """The whole message (a stream's `message_start` carries it with no content and `stop` None)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": list(content),
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": usage.as_dict(),
    }
