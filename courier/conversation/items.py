"""Constructors for Responses API items, the shape every stored and replayed history is made of."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from courier.conversation.ids import new_id
from courier.core.tools.calls import ToolCall
from courier.storage.records import JsonObject


def message_item(role: str, content: list[JsonObject], status: str = "completed") -> JsonObject:
    return {"id": new_id("msg"), "type": "message", "role": role, "status": status, "content": content}


def reasoning_item(text: str, status: str = "completed") -> JsonObject:
    """The model's reasoning as OpenAI's `reasoning` item: the text itself (`reasoning_text`), no summary, nothing
    encrypted."""
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
    }


def reasoning_text(item: Mapping[str, Any]) -> str:
    """The text of a reasoning item: its `reasoning_text` parts, else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(part.get("text", "") for part in parts)


def text_part(kind: str, text: str, logprobs: list[JsonObject] | None = None) -> JsonObject:
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": kind, "text": text}


def message_text(item: Mapping[str, Any]) -> str:
    """The text of a message item (image parts carry none)."""
    return "".join(part.get("text", "") for part in item["content"])


def image_urls(item: Mapping[str, Any]) -> list[str]:
    if item["type"] != "message":
        return []
    return [part["image_url"] for part in item["content"] if part["type"] == "input_image"]


def is_instruction(item: JsonObject) -> bool:
    """System and developer messages: compaction keeps them verbatim, in their roles."""
    return item["type"] == "message" and item["role"] in ("system", "developer")


def function_call_item(call: ToolCall) -> JsonObject:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "status": "completed",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }
