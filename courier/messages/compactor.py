"""The compactor's inbox: compact a history into instructions, retained items and one capsule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from courier.messages.base import Request, RequestFailed
from courier.messages.media import FetchMemo
from courier.storage.records import JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionResult:
    """`output`: the instructions and system/developer messages, the retained items, then one compaction item.

    `context`: what the model is shown from `output` on (its capsule replayed), so no one decodes it again."""

    output: tuple[JsonObject, ...]
    usage: JsonObject  # the one summary pass
    compaction_item: JsonObject
    context: tuple[JsonObject, ...]


CompactReply: TypeAlias = CompactionResult | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactHistory(Request[CompactionResult]):
    """Compact `context`: the history as the model is shown it, any earlier capsule already replayed by the caller
    (so it covers them too). `request_items`: the request's own items, so an image part is named where it was sent.
    """

    context: Sequence[JsonObject]
    request_items: Sequence[JsonObject]
    instructions: str | None
    tools: Sequence[Mapping[str, Any]] | None  # rendered in the replayed context (warm-up), never in the summary
    keep_tokens: int | None  # None: 1/16 of the context, at most 8192
    max_output_tokens: int
    session: str
    memo: FetchMemo | None = None  # images already read for this turn (automatic compaction): read once in all
    tenant: str = ""  # whose prompt-cache state the summary and the warm-up belong to
    # Summarize the whole history, keeping only the user's messages verbatim (a client that asked for a compaction
    # of everything: Codex's `compaction_trigger`, which keeps its user messages itself and drops the rest).
    summarize_all: bool = False


CompactorMessage: TypeAlias = CompactHistory
