"""The compactor's inbox: compact a history into instructions, retained items and one capsule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from courier.messages.base import Message, ReplyStream, RequestFailed
from courier.messages.media import FetchMemo
from courier.storage.records import JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionResult:
    """`output`: the instructions and system/developer messages, the retained items, then one compaction item."""

    output: tuple[JsonObject, ...]
    usage: JsonObject  # the one summary pass
    compaction_item: JsonObject


CompactReply: TypeAlias = CompactionResult | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactHistory(Message):
    """`items` may hold earlier capsules: they are replayed first, so the new capsule covers them."""

    items: Sequence[JsonObject]
    instructions: str | None
    tools: Sequence[Mapping[str, Any]] | None  # rendered in the replayed context (warm-up), never in the summary
    keep_tokens: int | None  # None: 1/16 of the context, at most 8192
    max_output_tokens: int
    session: str
    reply: ReplyStream[CompactReply]
    memo: FetchMemo | None = None  # images already read for this turn (automatic compaction): read once in all


CompactorMessage: TypeAlias = CompactHistory
