"""Which items a compaction keeps verbatim and which it summarizes.

The history (system and developer messages aside, which are always kept) is cut
into segments where a cut may fall: before a user message, or right after the
output that closes the last open tool call. So a tool call is never separated
from its output, and a history that ends inside an unfinished tool group keeps
the whole group. Kept: the segment holding the latest user message and all after
it, the most recent completed tool group, and then the newest whole segments
while the kept tokens stay within `keep_tokens`. The rest is summarized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from courier.storage.records import JsonObject

# The default verbatim budget: 1/16 of the context, at most 8192 tokens.
DEFAULT_KEEP_FRACTION = 16
MAX_DEFAULT_KEEP_TOKENS = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    retained: tuple[int, ...]  # segment indexes kept verbatim, in order
    summarized: tuple[int, ...]  # segment indexes summarized, in order


def segments(items: Sequence[JsonObject]) -> list[list[JsonObject]]:
    """Split (non-instruction) items where a cut may fall."""
    result: list[list[JsonObject]] = []
    current: list[JsonObject] = []
    open_calls: set[str] = set()
    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] == "user" and not open_calls and current:
            result.append(current)
            current = []
        current.append(item)
        if kind in ("function_call", "custom_tool_call"):
            open_calls.add(item["call_id"])
        elif kind in ("function_call_output", "custom_tool_call_output") and item["call_id"] in open_calls:
            open_calls.discard(item["call_id"])
            if not open_calls:
                result.append(current)
                current = []
    if current:
        result.append(current)
    return result


def closes_tool_group(segment: Sequence[JsonObject]) -> bool:
    return segment[-1]["type"] in ("function_call_output", "custom_tool_call_output") and any(
        item["type"] in ("function_call", "custom_tool_call") for item in segment
    )


def select(parts: Sequence[Sequence[JsonObject]], costs: Sequence[int], keep_tokens: int) -> Selection:
    """`costs[i]`: the tokens segment `i` renders to."""
    count = len(parts)
    users = [index for index, part in enumerate(parts) if any(_is_user(item) for item in part)]
    tail_start = users[-1] if users else count - 1
    kept = set(range(max(tail_start, 0), count))
    tool_groups = [index for index, part in enumerate(parts) if closes_tool_group(part)]
    if tool_groups:
        kept.add(tool_groups[-1])
    budget = keep_tokens - sum(costs[index] for index in kept)
    for index in range(tail_start - 1, -1, -1):
        if index in kept:
            continue
        if costs[index] > budget:
            break
        kept.add(index)
        budget -= costs[index]
    return Selection(
        retained=tuple(sorted(kept)), summarized=tuple(index for index in range(count) if index not in kept)
    )


def _is_user(item: JsonObject) -> bool:
    return bool(item["type"] == "message" and item["role"] == "user")
