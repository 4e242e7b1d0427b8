"""A chat message's content as the chat template sees it: a string, or parts when it holds images.

Text-only templates expect a string; a vision model's template writes its image
placeholder for each `{"type": "image"}` part. Adjacent text parts are joined, so
the text renders the same either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

IMAGE_PART: dict[str, Any] = {"type": "image"}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def chat_content(parts: Iterable[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """`parts` (text and image parts, in order) as a string when there is no image, else as merged parts."""
    merged: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "text" and merged and merged[-1]["type"] == "text":
            merged[-1] = text_part(merged[-1]["text"] + part["text"])
        else:
            merged.append(dict(part))
    if all(part["type"] == "text" for part in merged):
        return "".join(part["text"] for part in merged)
    return merged


def as_parts(content: Any) -> Any:
    """String content as one text part (a vision model's template iterates over parts); other content as is."""
    return [text_part(content)] if isinstance(content, str) else content


def has_images(messages: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any message's content holds an image part."""
    return any(
        isinstance(content := message.get("content"), list) and any(part.get("type") == "image" for part in content)
        for message in messages
    )
