"""Volatile lines: lines of a system prompt that change from one request to the next and mean nothing to the model.

Agents resend a stable system prompt of thousands of tokens every turn; a line near its top that changes between
requests makes every prompt leave the cache there, and all that follows is prefilled again. Such a line is left out
before the messages are rendered, for every dialect alike (the render is the one place prompts become tokens), so a
conversation's turns, its idle warm-up and its token counts all see the same prompt. Only system and developer
messages are touched: a user's own text is never changed.

What counts as volatile, from recorded requests (tests/data/agents/):

- `x-anthropic-billing-header: cc_version=...; cc_entrypoint=...;` (Claude Code; later versions add `cch=...`): billing
  metadata for Anthropic's API, first in the system prompt; its value differs between conversations (in some
  versions between requests).

A message made empty keeps its place (its index names it in errors), with empty text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Lines starting with these (case-insensitively, after leading blanks) are left out.
VOLATILE_LINE_STARTS = ("x-anthropic-billing-header:",)
ROLES = frozenset({"system", "developer"})


def without_volatile_lines(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """`messages` with the volatile lines of their system and developer messages left out (the same sequence when
    there are none)."""
    changed = [_message(message) for message in messages]
    if all(new is old for new, old in zip(changed, messages, strict=True)):
        return messages
    return changed


def _message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    if message.get("role") not in ROLES:
        return message
    content = message.get("content")
    if isinstance(content, str):
        text = _text(content)
        return message if text is content else {**message, "content": text}
    if not isinstance(content, list):
        return message
    parts = [_part(part) for part in content]
    if all(new is old for new, old in zip(parts, content, strict=True)):
        return message
    return {**message, "content": parts}


def _part(part: Any) -> Any:
    if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):
        return part
    text = _text(part["text"])
    return part if text is part["text"] else {**part, "text": text}


def _text(text: str) -> str:
    """`text` without its volatile lines (the same object when it has none)."""
    if not any(start in text.lower() for start in VOLATILE_LINE_STARTS):
        return text
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not line.lstrip().lower().startswith(VOLATILE_LINE_STARTS)]
    return "".join(kept) if len(kept) < len(lines) else text
