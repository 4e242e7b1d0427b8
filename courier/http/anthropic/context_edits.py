"""`context_management.edits`: what of the history the client asks to be cleared before the prompt is rendered.

`clear_thinking_20251015` is honoured: the reasoning of all but the latest `keep` assistant turns that carry some is
left out (`keep: "all"`, what Claude Code sends, clears nothing; Anthropic's default keeps 1). Clearing tool results
(`clear_tool_uses_20250919`) needs the prompt counted against a trigger first, which Courier does not do: it is a 400
naming the edit rather than a history silently served whole.
"""

from __future__ import annotations

from typing import Any

from courier.storage.records import JsonObject

DEFAULT_THINKING_TURNS = 1


def thinking_turns_kept(value: dict[str, Any] | None) -> int | None:
    """How many of the latest assistant turns keep their reasoning (None: all of them), from edits the schema has
    checked (only `clear_thinking_20251015` is taken); the last edit decides."""
    kept: int | None = None
    for edit in (value or {}).get("edits") or ():
        keep = edit.get("keep")
        kept = None if keep == "all" else DEFAULT_THINKING_TURNS if keep is None else int(keep["value"])
    return kept


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
