"""Responses API items: validating input items and building output items.

Every item the server stores carries a fresh id (`msg_`, `fc_`, `fco_`, `ctc_`, `ctco_`, `rs_`, `cmp_`),
so a conversation never holds two items with one id. Rendering items for the
model is `courier.conversation.chat_render`'s business. A reasoning item sent back sealed
(`encrypted_content`) is opened by `unsealed`, with the server's key, before anything reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from courier.conversation.ids import new_id
from courier.conversation.items import message_item, reasoning_item, text_part
from courier.conversation.sealed import ReasoningSeal, SealError
from courier.core.failure_codes import FailureCode
from courier.http.errors import ApiError
from courier.media.address_policy import MediaRefused
from courier.media.urls import parse_image_url
from courier.storage.records import JsonObject

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_UNSUPPORTED_PARTS = frozenset({"input_file", "input_audio"})
# The last input item of a request asking for a compaction (see request.py); nowhere else.
COMPACTION_TRIGGER = "compaction_trigger"


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
        item: JsonObject = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "completed",
            "call_id": _required_text(raw, "call_id", param),
            "name": _required_text(raw, "name", param),
            "arguments": _required_text(raw, "arguments", param),
        }
        return _with_namespace(item, raw, param)
    if kind == "custom_tool_call":
        item = {
            "id": new_id("ctc"),
            "type": "custom_tool_call",
            "status": "completed",
            "call_id": _required_text(raw, "call_id", param),
            "name": _required_text(raw, "name", param),
            "input": _text_field(raw, "input", param),
        }
        return _with_namespace(item, raw, param)
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {
            "id": new_id("fco" if kind == "function_call_output" else "ctco"),
            "type": kind,
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
    if kind == COMPACTION_TRIGGER:
        raise ApiError.invalid(f"{param}: a compaction_trigger item can only be the last input item", param=param)
    raise ApiError.invalid(
        f"{param}.type {kind!r} is not supported; use message, function_call, function_call_output, "
        "custom_tool_call, custom_tool_call_output, reasoning or compaction items",
        param=f"{param}.type",
    )


# A reasoning item's content parts: `reasoning_text` (this server's), `text` (as some clients write it back).
_REASONING_PARTS = {"content": ("reasoning_text", "text"), "summary": ("summary_text",)}


def _reasoning(raw: Mapping[str, Any], param: str) -> JsonObject:
    """A reasoning item sent back: its `reasoning_text` content (else its summary's text) is rendered into the
    assistant turn it belongs to, as the chat template expects. A sealed one (`encrypted_content`) is kept sealed
    here; `unsealed` opens it."""
    texts: dict[str, str] = {}
    for key, part_types in _REASONING_PARTS.items():
        parts = raw.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(part, dict) and part.get("type") in part_types and isinstance(part.get("text"), str)
            for part in parts
        ):
            raise ApiError.invalid(
                f"{param}.{key} must be a list of {part_types[0]} parts with a string 'text'", param=f"{param}.{key}"
            )
        texts[key] = "".join(part["text"] for part in parts)
    item = reasoning_item(texts.get("content") or texts.get("summary", ""))
    sealed = raw.get("encrypted_content")
    if sealed is not None:
        if not isinstance(sealed, str) or not sealed:
            message = f"{param}.encrypted_content must be a non-empty string"
            raise ApiError.invalid(message, param=f"{param}.encrypted_content")
        item["encrypted_content"] = sealed
    return item


def unsealed(seal: ReasoningSeal, items: Sequence[JsonObject], param: str = "input") -> list[JsonObject]:
    """`items` with each sealed reasoning item opened: its text is what the seal holds, whatever else it says. A
    seal this server did not make, or one altered, is a 400 naming the item (never read, never dropped)."""
    result = []
    for index, item in enumerate(items):
        if item["type"] != "reasoning" or item.get("encrypted_content") is None:
            result.append(item)
            continue
        try:
            text = seal.unseal(item["encrypted_content"])
        except SealError as error:
            where = f"{param}[{index}].encrypted_content"
            raise ApiError.invalid(
                f"{where}: {error}", param=where, code=FailureCode.INVALID_ENCRYPTED_CONTENT
            ) from None
        result.append({**item, "content": [{"type": "reasoning_text", "text": text}]})
    return result


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
        raise ApiError.invalid(f"{param}: {refused}", param=param, code=FailureCode.INVALID_IMAGE_URL) from None
    detail = part.get("detail", "auto")
    return {"type": "input_image", "image_url": url, "detail": detail if isinstance(detail, str) else "auto"}


def _with_namespace(item: JsonObject, raw: Mapping[str, Any], param: str) -> JsonObject:
    """A call to a tool in a namespace names it (`namespace`), as the API defines; the model knows it qualified."""
    namespace = raw.get("namespace")
    if namespace is not None:
        if not isinstance(namespace, str) or not namespace:
            raise ApiError.invalid(f"{param}.namespace must be a non-empty string", param=f"{param}.namespace")
        item["namespace"] = namespace
    return item


def _text_field(raw: Mapping[str, Any], key: str, param: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise ApiError.invalid(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


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
