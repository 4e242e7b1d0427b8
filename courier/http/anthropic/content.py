"""Anthropic's `system` and `messages` as the chat template's messages, with the images they refer to.

- `system` (a string or text blocks, joined by newlines) is the first message, role `system`. Claude Code's
  `x-anthropic-billing-header: ...` block stays in it here: the render leaves such volatile lines out for every
  dialect (`core/volatile_lines.py`, unless `--no-prompt-cache-normalize`).
- A user message's text and image blocks are one user message (images as parts, admitted like chat's); each
  `tool_result` block is a `tool` message (`tool_call_id` from `tool_use_id`), in order, its content a string or
  text and image blocks (Claude Code's screenshots; the images admitted as a user message's are, and rendered where
  the template puts a tool message's image parts), prefixed `Error: ` when `is_error` (a chat template has no other
  way to tell).
- An assistant message's `thinking` blocks are its `reasoning_content` (the name templates read), its text its
  content, each `tool_use` a tool call with `input` as the arguments. `redacted_thinking` is accepted and left out:
  it is another server's encrypted reasoning, which no one here can read.
- `role: system` inside `messages` (Claude Code's mid-conversation system messages) stays a system message where it
  stands; whether the template renders it there is the template's business.

Every refusal is a 400 naming the block (`messages[2].content[0]`). `cache_control` is accepted anywhere: the prompt
cache here is automatic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from courier.conversation.chat_content import IMAGE_PART, chat_content, text_part
from courier.conversation.chat_render import template_tool_call
from courier.http.errors import ApiError
from courier.media.address_policy import MediaRefused
from courier.media.urls import parse_image_url
from courier.messages.media import ImageRef
from courier.storage.records import JsonObject

ROLES = ("user", "assistant", "system")
ERROR_PREFIX = "Error: "


@dataclass(slots=True)
class Translation:
    """The chat messages built so far, and the images their parts refer to (in order)."""

    messages: list[JsonObject] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)


def chat_messages(system: Any, messages: Any) -> tuple[list[JsonObject], tuple[ImageRef, ...]]:
    """`system` and `messages` checked and translated; a last message from the assistant (a prefill to continue)
    is refused: a reply here always starts a new assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("'messages' must be a non-empty list of message objects", param="messages")
    out = Translation()
    system_text = _system_text(system)
    if system_text:
        out.messages.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        _message(message, f"messages[{index}]", out)
    if messages[-1].get("role") == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise ApiError.invalid(
            f"{where}: a final assistant message (a prefill for the reply to continue) is not supported; "
            "end with a user message",
            param=where,
        )
    return out.messages, tuple(out.images)


def _system_text(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise ApiError.invalid("'system' must be a string or a list of text blocks", param="system")
    texts = [_text_block(block, f"system[{index}]") for index, block in enumerate(system)]
    return "\n".join(texts)


def _message(message: Any, param: str, out: Translation) -> None:
    if not isinstance(message, dict):
        raise ApiError.invalid(f"{param} must be an object", param=param)
    role = message.get("role")
    if role not in ROLES:
        raise ApiError.invalid(f"{param}.role must be one of {', '.join(ROLES)}, not {role!r}", param=f"{param}.role")
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        where = f"{param}.content"
        raise ApiError.invalid(f"{where} must be a string or a list of content blocks", param=where)
    if role == "assistant":
        out.messages.append(_assistant(content, f"{param}.content"))
    elif role == "system":
        texts = [_text_block(block, f"{param}.content[{index}]") for index, block in enumerate(content)]
        out.messages.append({"role": "system", "content": "\n".join(texts)})
    else:
        _user(content, f"{param}.content", out)


def _user(blocks: list[Any], param: str, out: Translation) -> None:
    """Tool results become `tool` messages; the text and images around them, user messages, all in order."""
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.messages.append({"role": "user", "content": chat_content(parts)})
            parts.clear()

    for index, block in enumerate(blocks):
        where = f"{param}[{index}]"
        kind = _block_type(block, where)
        if kind == "text":
            parts.append(text_part(_text_block(block, where)))
        elif kind == "image":
            out.images.append(ImageRef(url=_image_url(block, where), param=where))
            parts.append(IMAGE_PART)
        elif kind == "tool_result":
            flush()
            out.messages.append(_tool_result(block, where, out.images))
        else:
            raise _unsupported(kind, where, "text, image and tool_result")
    flush()


def _assistant(blocks: list[Any], param: str) -> JsonObject:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[JsonObject] = []
    for index, block in enumerate(blocks):
        where = f"{param}[{index}]"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", where))
        elif kind == "redacted_thinking":
            continue  # another server's encrypted reasoning: nothing here can read it
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        else:
            raise _unsupported(kind, where, "text, thinking, redacted_thinking and tool_use")
    text = "".join(texts)
    message: JsonObject = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _tool_use(block: dict[str, Any], param: str) -> JsonObject:
    call_id = _string(block, "id", param)
    name = _string(block, "name", param)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise ApiError.invalid(f"{param}.input must be an object", param=f"{param}.input")
    return template_tool_call(call_id, name, arguments)


def _tool_result(block: dict[str, Any], param: str, images: list[ImageRef]) -> JsonObject:
    """A `tool` message: its text, or text and image parts in order when the result holds images (a screenshot),
    each admitted as a user message's image is (collected in `images`)."""
    call_id = _string(block, "tool_use_id", param)
    content = block.get("content", "")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise ApiError.invalid(f"{param}.is_error must be a boolean", param=f"{param}.is_error")
    parts = [text_part(ERROR_PREFIX)] if is_error else []
    if isinstance(content, str):
        parts.append(text_part(content))
    elif isinstance(content, list):
        for index, part in enumerate(content):
            parts.append(_result_part(part, f"{param}.content[{index}]", images))
    else:
        where = f"{param}.content"
        raise ApiError.invalid(f"{where} must be a string or a list of text and image blocks", param=where)
    return {"role": "tool", "tool_call_id": call_id, "content": chat_content(parts)}


def _result_part(block: Any, param: str, images: list[ImageRef]) -> dict[str, Any]:
    kind = _block_type(block, param)
    if kind == "image":
        images.append(ImageRef(url=_image_url(block, param), param=param))
        return IMAGE_PART
    if kind != "text":
        raise _unsupported(kind, param, "text and image")
    return text_part(_text_block(block, param))


def _image_url(block: dict[str, Any], param: str) -> str:
    """An image block's source as the URL the media fetcher reads: base64 data as a `data:` URL, or the URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise ApiError.invalid(f"{param}.source needs a string media_type and data", param=f"{param}.source")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        assert isinstance(source, dict)
        given = source.get("url")
        if not isinstance(given, str) or not given:
            raise ApiError.invalid(f"{param}.source.url must be a URL", param=f"{param}.source.url")
        url = given
    else:
        raise ApiError.invalid(
            f"{param}.source must be a base64 or url image source (file sources need Anthropic's Files API)",
            param=f"{param}.source",
        )
    try:
        parse_image_url(url)
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param) from None
    return url


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ApiError.invalid(f"{param} must be a content block with a 'type'", param=param)
    return str(block["type"])


def _text_block(block: Any, param: str) -> str:
    kind = _block_type(block, param)
    if kind != "text":
        raise _unsupported(kind, param, "text")
    return _string(block, "text", param)


def _string(block: dict[str, Any], key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError.invalid(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _unsupported(kind: str, param: str, accepted: str) -> ApiError:
    return ApiError.invalid(f"{param}: {kind[:40]!r} blocks are not supported here (only {accepted})", param=param)
