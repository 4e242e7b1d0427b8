"""Items as the chat template's messages: the one translation every Responses turn renders through.

A new turn, the token count of `/v1/responses/input_tokens`, a compaction's
counts and the idle warm-ups all render through `chat_messages`, which is what
makes a stored chain's prompt an exact prefix of its next turn's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from courier.conversation.chat_content import IMAGE_PART, chat_content, text_part
from courier.core.tool_calls import json_arguments
from courier.storage.records import JsonObject


def chat_messages(instructions: str | None, items: Iterable[Mapping[str, Any]]) -> list[JsonObject]:
    """Items as the chat template's messages: function calls join the assistant message before them."""
    messages: list[JsonObject] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": chat_content(_parts(item))})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": json_arguments(item["arguments"])},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _parts(item: Mapping[str, Any]) -> list[JsonObject]:
    """A message item's content as chat parts: its text, and a placeholder part for each image."""
    return [
        IMAGE_PART if part["type"] == "input_image" else text_part(part.get("text", "")) for part in item["content"]
    ]


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[JsonObject]:
    """Responses function tools (flat) -> the chat template's tool shape (nested under `function`)."""
    return [
        {
            "type": "function",
            "function": {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None},
        }
        for tool in tools
    ]
