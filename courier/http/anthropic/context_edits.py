"""`context_management.edits`: what of the history the client asks to be cleared before the prompt is rendered.

`clear_thinking_20251015` is honoured: the reasoning of all but the latest `keep` assistant turns that carry some is
left out (`keep: "all"`, what Claude Code sends, clears nothing; Anthropic's default keeps 1). Clearing tool results
(`clear_tool_uses_20250919`) needs the prompt counted against a trigger first, which Courier does not do: it is a 400
naming the edit rather than a history silently served whole.
"""

from __future__ import annotations

from typing import Any

from courier.http.errors import ApiError
from courier.storage.records import JsonObject

CLEAR_THINKING = "clear_thinking_20251015"
DEFAULT_THINKING_TURNS = 1


def thinking_turns_kept(value: Any) -> int | None:
    """How many of the latest assistant turns keep their reasoning (None: all of them)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError.invalid("'context_management' must be an object", param="context_management")
    edits = value.get("edits", [])
    if not isinstance(edits, list):
        raise ApiError.invalid("'context_management.edits' must be a list", param="context_management.edits")
    kept: int | None = None
    for index, edit in enumerate(edits):
        param = f"context_management.edits[{index}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != CLEAR_THINKING:
            raise ApiError.invalid(
                f"{param}: only {CLEAR_THINKING} edits are supported, not {str(kind)[:60]!r} (tool results are "
                "never cleared here; drop the edit or send a shorter history)",
                param=param,
            )
        assert isinstance(edit, dict)
        kept = _keep(edit.get("keep"), f"{param}.keep")
    return kept


def _keep(keep: Any, param: str) -> int | None:
    if keep == "all":
        return None
    if keep is None:
        return DEFAULT_THINKING_TURNS
    value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError.invalid(f"{param} must be 'all' or {{'type': 'thinking_turns', 'value': N}}", param=param)
    return value


def clear_thinking(messages: list[JsonObject], kept: int | None) -> list[JsonObject]:
    """`messages` with the reasoning of all but the latest `kept` assistant turns that carry some taken out."""
    if kept is None:
        return messages
    carrying = [index for index, message in enumerate(messages) if message.get("reasoning_content")]
    cleared = set(carrying[: max(0, len(carrying) - kept)])
    return [
        {key: value for key, value in message.items() if key != "reasoning_content"} if index in cleared else message
        for index, message in enumerate(messages)
    ]
