"""SnapshotStoreActor: owns the snapshot store (the prompt cache of model states); no one else touches it.

Receives `LookupPrefix` (replies `PrefixFound` or `PrefixMissed`), `InsertSnapshot`
(no reply), `ReadSnapshotStats` (replies a copy of its figures) and `ResetSnapshots`
(replies freed entries and bytes). The store's invariants (supersede before byte
accounting; the byte cap never exceeded) live in `core/snapshot_store.py`; this
shell moves messages, sweeps expired entries on a periodic tick, and records what
each operation did on its span.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import TypeVar

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from opentelemetry import trace

from courier.core.snapshot_store import SnapshotStore
from courier.messages.snapshot_store import (
    InsertSnapshot,
    LookupPrefix,
    PrefixFound,
    PrefixMissed,
    ReadSnapshotStats,
    ResetSnapshots,
    SnapshotStoreMessage,
)
from courier.runtime import trace_attributes
from courier.runtime.actor import Actor

T = TypeVar("T")

SWEEP_INTERVAL_S = 60.0
MAX_LOGGED_SESSIONS = 1024

logger = logging.getLogger(__name__)


class SnapshotStoreActor(Actor[SnapshotStoreMessage]):
    name = "snapshot_store"

    def __init__(self, store: SnapshotStore) -> None:
        self._store = store
        # Bounded: beyond this many sessions, further self-evictions are only counted.
        self._self_evicted_sessions: set[str] = set()

    async def background(self) -> None:
        """Sweep expired snapshots on a periodic tick (lookups also sweep lazily)."""
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            self._store.sweep()

    async def handle(self, message: SnapshotStoreMessage) -> None:
        match message:
            case LookupPrefix():
                await self._on_lookup_prefix(message)
            case InsertSnapshot():
                self._on_insert_snapshot(message)
            case ReadSnapshotStats():
                await _answer(message.reply, self._store.stats())
            case ResetSnapshots():
                await _answer(message.reply, self._store.reset())

    async def _on_lookup_prefix(self, message: LookupPrefix) -> None:
        if message.check_extended and self._store.extended(message.bucket, message.session, message.tokens):
            await _answer(message.reply, PrefixMissed(extended=True))
            return
        result = self._store.lookup(message.bucket, message.session, message.tokens)
        span = trace.get_current_span()
        span.set_attribute(trace_attributes.SNAPSHOT_MATCHED, result.matched)
        if result.snapshot is None:
            await _answer(message.reply, PrefixMissed())
            return
        found = PrefixFound(
            state=result.snapshot.state,
            length=len(result.snapshot.tokens),
            matched=result.matched,
            trimmed=result.trimmed,
            continues=result.continues,
        )
        await _answer(message.reply, found)

    def _on_insert_snapshot(self, message: InsertSnapshot) -> None:
        result = self._store.insert(
            bucket=message.bucket,
            session=message.session,
            origin=message.origin,
            tokens=message.tokens,
            state=message.state,
            nbytes=message.nbytes,
            continues=message.continues,
            prompt_length=message.prompt_length,
        )
        span = trace.get_current_span()
        span.set_attribute(trace_attributes.SNAPSHOT_ACCEPTED, result.accepted)
        span.set_attribute(trace_attributes.SNAPSHOT_SUPERSEDED, result.superseded)
        span.set_attribute(trace_attributes.SNAPSHOT_FREED_BYTES, result.freed_bytes)
        span.set_attribute(trace_attributes.SNAPSHOT_EVICTED, result.evicted)
        logged = self._self_evicted_sessions
        if result.self_evicted and message.session not in logged and len(logged) < MAX_LOGGED_SESSIONS:
            logged.add(message.session)  # once per session
            logger.warning(
                "prompt cache: session %r evicted its own snapshots to make room; the cache budget "
                "(--prompt-cache-snapshot-capacity-bytes) is too small for the conversations it serves",
                message.session or "<anonymous>",
            )


async def _answer(reply: MemoryObjectSendStream[T], value: T) -> None:
    """Reply, unless the asker has stopped waiting (the scheduler gives a lookup a deadline): nothing to tell."""
    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await reply.send(value)
