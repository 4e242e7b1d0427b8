"""Responses API items: input items read (their shapes checked by `schemas/responses.py`) and output items built.

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


def input_items(value: str | list[dict[str, Any]], param: str = "input") -> list[JsonObject]:
    """A string or a list of items, which the schema has checked (`schemas/responses.py`) -> normalized items with
    fresh ids."""
    if isinstance(value, str):
        return [message_item("user", [text_part("input_text", value)])]
    return [_input_item(raw, f"{param}[{index}]") for index, raw in enumerate(value)]


def _input_item(raw: dict[str, Any], param: str) -> JsonObject:
    kind = raw.get("type") or "message"
    if kind == "message":
        return _message(raw, param)
    if kind in ("function_call", "custom_tool_call"):
        custom = kind == "custom_tool_call"
        item: JsonObject = {"id": new_id("ctc" if custom else "fc"), "type": kind, "status": "completed"}
        item.update(call_id=raw["call_id"], name=raw["name"])
        item["input" if custom else "arguments"] = raw["input" if custom else "arguments"]
        if raw.get("namespace") is not None:  # a call to a tool in a namespace names it, as the API defines
            item["namespace"] = raw["namespace"]
        return item
    if kind in ("function_call_output", "custom_tool_call_output"):
        output = raw["output"]
        return {
            "id": new_id("fco" if kind == "function_call_output" else "ctco"),
            "type": kind,
            "status": "completed",
            "call_id": raw["call_id"],
            "output": output if isinstance(output, str) else "".join(part["text"] for part in output),
        }
    if kind == "compaction":
        # Checked when the history is replayed (`courier.conversation.replay`), where the server's key is known.
        return {"id": new_id("cmp"), "type": "compaction", "encrypted_content": raw["encrypted_content"]}
    if kind == "reasoning":
        return _reasoning(raw)
    # Only `compaction_trigger` reaches here: a create takes it off the end of its input before reading the items.
    raise ApiError.invalid(
        f"{param}: a {kind} item asks a create (POST /v1/responses) for a compaction, as its last input item; "
        "it is taken nowhere else",
        param=param,
    )


def _reasoning(raw: Mapping[str, Any]) -> JsonObject:
    """A reasoning item sent back: its `reasoning_text` content (else its summary's text) is rendered into the
    assistant turn it belongs to, as the chat template expects. A sealed one (`encrypted_content`) is kept sealed
    here; `unsealed` opens it."""
    content, summary = ("".join(part["text"] for part in raw.get(key) or ()) for key in ("content", "summary"))
    item = reasoning_item(content or summary)
    if raw.get("encrypted_content") is not None:
        item["encrypted_content"] = raw["encrypted_content"]
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
    role = raw["role"]
    kind = "output_text" if role == "assistant" else "input_text"
    content = raw["content"]
    if isinstance(content, str):
        return message_item(role, [text_part(kind, content)])
    parts: list[JsonObject] = []
    for index, part in enumerate(content):
        if part["type"] == "input_image":
            parts.append(_image_part(part, f"{param}.content[{index}]"))
        else:
            parts.append(text_part(kind, part["refusal"] if part["type"] == "refusal" else part["text"]))
    return message_item(role, parts)


def _image_part(part: Mapping[str, Any], param: str) -> JsonObject:
    url = part["image_url"]
    try:
        parse_image_url(url)  # refused here, naming the part, unless the media fetcher could read it
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param, code=FailureCode.INVALID_IMAGE_URL) from None
    return {"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"}
