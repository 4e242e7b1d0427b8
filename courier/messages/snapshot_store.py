"""The snapshot store's inbox: find the longest cached prefix of a prompt; keep a new snapshot; report; reset; flush
to disk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from courier.core.prompt_cache.entries import Bucket, EntryId, Origin
from courier.core.prompt_cache.stats import StoreStats
from courier.messages.base import Request
from courier.runtime.message import Message, ReplyStream


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixFound:
    """Reuse `state` for the first `matched` tokens (trim it to that length first when `trimmed`)."""

    state: Any
    length: int
    matched: int
    trimmed: bool
    # This conversation's last completion snapshot, which the coming completion snapshot supersedes.
    continues: EntryId | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixMissed:
    # Asked with `check_extended`: the session already holds a snapshot that starts with the looked-up tokens.
    extended: bool = False


LookupReply: TypeAlias = PrefixFound | PrefixMissed


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupPrefix(Message):
    bucket: Bucket
    session: str
    tokens: tuple[int, ...]
    reply: ReplyStream[LookupReply]
    check_extended: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertSnapshot(Message):
    """Keep `state` (already a private copy) for `tokens`; no reply."""

    bucket: Bucket
    session: str
    origin: Origin
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    continues: EntryId | None = None
    prompt_length: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetSnapshots(Request[tuple[int, int, int]]):
    """Drop every snapshot, files included; replies (entries, memory bytes, disk bytes) freed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushSnapshots(Request[int]):
    """Write every snapshot memory holds that has no file yet, and wait for the disk to finish what it was asked
    (before a clean stop); replies how many were written. Without a disk tier, 0 at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadSnapshotStats(Request[StoreStats]):
    """What the store holds and has done (for `/v1/cache/stats` and `/metrics`); replies a copy."""


SnapshotStoreMessage: TypeAlias = LookupPrefix | InsertSnapshot | ResetSnapshots | ReadSnapshotStats | FlushSnapshots
