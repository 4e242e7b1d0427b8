"""Responses API items: validating input items and building output items.

Every item the server stores carries a fresh id (`msg_`, `fc_`, `fco_`, `cmp_`),
so a conversation never holds two items with one id. Rendering items for the
model is `courier.conversation.chat_render`'s business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from courier.conversation.ids import new_id
from courier.conversation.items import message_item, reasoning_item, text_part
from courier.http.errors import ApiError
from courier.media.address_policy import MediaRefused
from courier.media.urls import parse_image_url
from courier.storage.records import JsonObject

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_UNSUPPORTED_PARTS = frozenset({"input_file", "input_audio"})


def input_items(value: Any, param: str = "input") -> list[JsonObject]:
    """A string or a list of items -> normalized items with fresh ids."""
    if isinstance(value, str):
        return [message_item("user", [text_part("input_text", value)])]
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(f"'{param}' must be a string or a non-empty list of items", param=param)
    return [_input_item(raw, f"{param}[{index}]") for index, raw in enumerate(value)]


def _input_item(raw: Any, param: str) -> JsonObject:
    if not isinstance(raw, dict):
        raise ApiError.invalid(f"{param} must be an object", param=param)
    kind = raw.get("type", "message")
    if not isinstance(kind, str):
        raise ApiError.invalid(f"{param}.type must be a string", param=f"{param}.type")
    if kind == "message":
        return _message(raw, param)
    if kind == "function_call":
        return {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "completed",
            "call_id": _required_text(raw, "call_id", param),
            "name": _required_text(raw, "name", param),
            "arguments": _required_text(raw, "arguments", param),
        }
    if kind == "function_call_output":
        return {
            "id": new_id("fco"),
            "type": "function_call_output",
            "status": "completed",
            "call_id": _required_text(raw, "call_id", param),
            "output": _output_text(raw.get("output"), f"{param}.output"),
        }
    if kind == "compaction":
        # Checked when the history is replayed (`courier.conversation.replay`), where the server's key is known.
        return {
            "id": new_id("cmp"),
            "type": "compaction",
            "encrypted_content": _required_text(raw, "encrypted_content", param),
        }
    if kind == "reasoning":
        return _reasoning(raw, param)
    raise ApiError.invalid(
        f"{param}.type {kind!r} is not supported; use message, function_call, function_call_output, reasoning or "
        "compaction items",
        param=f"{param}.type",
    )


def _reasoning(raw: Mapping[str, Any], param: str) -> JsonObject:
    """A reasoning item sent back: its `reasoning_text` content (else its summary's text) is rendered into the
    assistant turn it belongs to, as the chat template expects. Encrypted reasoning (another server's) cannot be
    read here, so it is refused rather than dropped."""
    if raw.get("encrypted_content") is not None:
        raise ApiError.invalid(
            f"{param}.encrypted_content cannot be read by this server (it never encrypts reasoning); "
            "send the reasoning's content instead",
            param=f"{param}.encrypted_content",
        )
    texts: dict[str, str] = {}
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = raw.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(part, dict) and part.get("type") == part_type and isinstance(part.get("text"), str)
            for part in parts
        ):
            raise ApiError.invalid(
                f"{param}.{key} must be a list of {part_type} parts with a string 'text'", param=f"{param}.{key}"
            )
        texts[key] = "".join(part["text"] for part in parts)
    return reasoning_item(texts.get("content") or texts.get("summary", ""))


def _message(raw: Mapping[str, Any], param: str) -> JsonObject:
    role = raw.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise ApiError.invalid(
            f"{param}.role must be one of {sorted(MESSAGE_ROLES)}, not {role!r}", param=f"{param}.role"
        )
    kind = "output_text" if role == "assistant" else "input_text"
    content = raw.get("content")
    if isinstance(content, str):
        return message_item(role, [text_part(kind, content)])
    if not isinstance(content, list):
        raise ApiError.invalid(f"{param}.content must be a string or a list of content parts", param=f"{param}.content")
    parts: list[JsonObject] = []
    for index, part in enumerate(content):
        part_param = f"{param}.content[{index}]"
        part_type = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part_type, str):
            raise ApiError.invalid(f"{part_param} must be an object with a string 'type'", param=part_param)
        if part_type in _UNSUPPORTED_PARTS:
            raise ApiError.invalid(f"{part_param}: {part_type} parts are not supported", param=part_param)
        if part_type == "input_image":
            parts.append(_image_part(part, part_param))
        elif part_type == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(text_part(kind, part["refusal"]))
        elif part_type in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(text_part(kind, part["text"]))
        else:
            raise ApiError.invalid(f"{part_param} must be a text part with a string 'text'", param=part_param)
    return message_item(role, parts)


def _image_part(part: Mapping[str, Any], param: str) -> JsonObject:
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise ApiError.invalid(
            f"{param}: file_id needs a Files API this server does not have; send image_url", param=param
        )
    if not isinstance(url, str) or not url:
        raise ApiError.invalid(f"{param}.image_url must be a URL (http(s), data: or file://)", param=param)
    try:
        parse_image_url(url)  # refused here, naming the part, unless the media fetcher could read it
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param) from None
    detail = part.get("detail", "auto")
    return {"type": "input_image", "image_url": url, "detail": detail if isinstance(detail, str) else "auto"}


def _required_text(raw: Mapping[str, Any], key: str, param: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ApiError.invalid(f"{param}.{key} must be a non-empty string", param=f"{param}.{key}")
    return value


def _output_text(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(
        isinstance(part, dict) and str(part.get("type")) in _TEXT_PARTS and isinstance(part.get("text"), str)
        for part in output
    ):
        return "".join(part["text"] for part in output)
    raise ApiError.invalid(f"{param} must be a string or a list of text parts", param=param)
