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

The shapes are the schema's (`schemas/anthropic.py`, checked before anything here reads them): what is left here is
a last message from the assistant, a user message with no content block, and an image URL the media fetcher could
not read, each a 400 naming what it refuses (an assistant message with no block is taken: a reply may have had none).
`cache_control` is accepted anywhere: the prompt cache here is automatic.
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

ERROR_PREFIX = "Error: "


@dataclass(slots=True)
class Translation:
    """The chat messages built so far, and the images their parts refer to (in order)."""

    messages: list[JsonObject] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> tuple[list[JsonObject], tuple[ImageRef, ...]]:
    """`system` and `messages`, which the schema has checked, translated; a last message from the assistant (a
    prefill to continue) is refused: a reply here always starts a new assistant turn."""
    out = Translation()
    system_text = _texts(system)
    if system_text:
        out.messages.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if message["role"] == "assistant":
            out.messages.append(_assistant(blocks))
        elif message["role"] == "system":
            out.messages.append({"role": "system", "content": _texts(blocks)})
        elif not blocks:  # nothing to render: the turn would vanish, and the reply answer what came before
            where = f"messages[{index}].content"
            raise ApiError.invalid(f"{where}: a user message needs at least one content block", param=where)
        else:
            _user(blocks, f"messages[{index}].content", out)
    if messages[-1]["role"] == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise ApiError.invalid(
            f"{where}: a final assistant message (a prefill for the reply to continue) is not supported; "
            "end with a user message",
            param=where,
        )
    return out.messages, tuple(out.images)


def _texts(blocks: str | list[dict[str, Any]] | None) -> str:
    """A string, or text blocks joined by newlines."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(block["text"] for block in blocks)


def _user(blocks: list[dict[str, Any]], param: str, out: Translation) -> None:
    """Tool results become `tool` messages; the text and images around them, user messages, all in order."""
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.messages.append({"role": "user", "content": chat_content(parts)})
            parts.clear()

    for index, block in enumerate(blocks):
        if block["type"] == "text":
            parts.append(text_part(block["text"]))
        elif block["type"] == "image":
            where = f"{param}[{index}]"
            out.images.append(ImageRef(url=_image_url(block["source"], where), param=where))
            parts.append(IMAGE_PART)
        else:
            flush()
            out.messages.append(_tool_result(block, f"{param}[{index}]", out.images))
    flush()


def _assistant(blocks: list[dict[str, Any]]) -> JsonObject:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[JsonObject] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(block["text"])
        elif kind == "thinking":
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(template_tool_call(block["id"], block["name"], block.get("input", {})))
        # redacted_thinking: another server's encrypted reasoning, which nothing here can read
    text = "".join(texts)
    message: JsonObject = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _tool_result(block: dict[str, Any], param: str, images: list[ImageRef]) -> JsonObject:
    """A `tool` message: its text, or text and image parts in order when the result holds images (a screenshot),
    each admitted as a user message's image is (collected in `images`)."""
    content = block.get("content", "")
    parts = [text_part(ERROR_PREFIX)] if block.get("is_error", False) else []
    if isinstance(content, str):
        parts.append(text_part(content))
    else:
        for index, part in enumerate(content):
            if part["type"] == "image":
                where = f"{param}.content[{index}]"
                images.append(ImageRef(url=_image_url(part["source"], where), param=where))
                parts.append(IMAGE_PART)
            else:
                parts.append(text_part(part["text"]))
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": chat_content(parts)}


def _image_url(source: dict[str, Any], param: str) -> str:
    """An image block's source as the URL the media fetcher reads: base64 data as a `data:` URL, or the URL."""
    url = f"data:{source['media_type']};base64,{source['data']}" if source["type"] == "base64" else source["url"]
    try:
        parse_image_url(url)
    except MediaRefused as refused:
        raise ApiError.invalid(f"{param}: {refused}", param=param) from None
    return str(url)
