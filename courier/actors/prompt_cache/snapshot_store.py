"""SnapshotStoreActor: owns the snapshot store (the prompt cache of model states); no one else touches it.

Receives `LookupPrefix` (replies `PrefixFound` or `PrefixMissed`), `InsertSnapshot`
(no reply), `ReadSnapshotStats` (replies a copy of its figures), `ResetSnapshots`
(replies freed entries, memory bytes and disk bytes) and `FlushSnapshots` (replies how many it wrote).
The store's invariants (supersede before byte accounting; both tiers' byte caps
never exceeded) live in `core/prompt_cache/store.py`; this shell moves messages, hands
what the store asks of the disk to the disk tier's worker (`snapshot_disk.py`),
sweeps expired entries on a periodic tick, and records what each operation did on
its span. A lookup that hits an entry only on disk is answered from a side task once
the file is read back, so other lookups and inserts do not wait for the disk. A lookup
that missed, or left its conversation's cached history, says where the prompt first
differed from the closest cached entry, as text, on its span and in the last
`DIVERGENCES_KEPT` kept for the stats.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from opentelemetry import trace

from courier.actors.prompt_cache.snapshot_disk import SnapshotDisk
from courier.core.prompt_cache.divergence import DivergenceReport, report, token_ids
from courier.core.prompt_cache.entries import LookupResult
from courier.core.prompt_cache.stats import StoreStats
from courier.core.prompt_cache.store import SnapshotStore
from courier.messages.snapshot_store import (
    FlushSnapshots,
    InsertSnapshot,
    LookupPrefix,
    LookupReply,
    PrefixFound,
    PrefixMissed,
    ReadSnapshotStats,
    ResetSnapshots,
    SnapshotStoreMessage,
)
from courier.runtime import trace_attributes
from courier.runtime.actor import Actor
from courier.runtime.concurrent_actor import SideTasks

T = TypeVar("T")

SWEEP_INTERVAL_S = 60.0
MAX_LOGGED_SESSIONS = 1024
# Files read back at once; a lookup beyond them is a miss (counted), never a queue behind the disk.
MAX_RESTORES = 4
# Divergences kept for `/v1/cache/stats`: the most recent, across tenants (each caller sees its own).
DIVERGENCES_KEPT = 64

logger = logging.getLogger(__name__)


class SnapshotStoreActor(Actor[SnapshotStoreMessage]):
    name = "snapshot_store"

    def __init__(
        self,
        store: SnapshotStore,
        disk: SnapshotDisk | None = None,
        *,
        decode: Callable[[Sequence[int]], str] = token_ids,
    ) -> None:
        self._store = store
        self._disk = disk
        self._decode = decode  # the model's tokenizer: divergences are shown as text
        self._divergences: deque[DivergenceReport] = deque(maxlen=DIVERGENCES_KEPT)
        self._restores: SideTasks[LookupPrefix] = SideTasks(MAX_RESTORES, self.fault)
        # Bounded: beyond this many sessions, further self-evictions are only counted.
        self._self_evicted_sessions: set[str] = set()

    async def background(self) -> None:
        """Sweep expired snapshots on a periodic tick (lookups also sweep lazily); run the disk tier's writer."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._restores.run)
            if self._disk is not None:
                group.start_soon(self._disk.run_writer, self._store)
            while True:
                await anyio.sleep(SWEEP_INTERVAL_S)
                self._store.sweep()
                self._dispatch()

    async def handle(self, message: SnapshotStoreMessage) -> None:
        try:
            match message:
                case LookupPrefix():
                    await self._on_lookup_prefix(message)
                case InsertSnapshot():
                    self._on_insert_snapshot(message)
                case ReadSnapshotStats():
                    await _answer(message.reply, self._stats())
                case ResetSnapshots():
                    memory, disk = self._store.nbytes, self._store.disk_nbytes
                    entries, _ = self._store.reset()
                    await _answer(message.reply, (entries, memory, disk))
                case FlushSnapshots():
                    await self._on_flush(message)
        finally:
            self._dispatch()

    def _dispatch(self) -> None:
        if self._disk is not None:
            self._disk.dispatch(self._store)

    def _stats(self) -> StoreStats:
        stats = replace(self._store.stats(), divergences=tuple(self._divergences))
        if self._disk is None:
            return stats
        return replace(stats, disk_io=self._disk.figures(), disk_directory=str(self._disk.directory.path))

    async def _on_flush(self, message: FlushSnapshots) -> None:
        if self._disk is None:
            await _answer(message.reply, 0)
            return
        unwritten = [entry.entry_id for entry in self._store.snapshots() if entry.in_memory and not entry.on_disk]
        self._store.flush()
        self._disk.dispatch(self._store, bounded=False)
        await self._disk.drained()
        await self._disk.stamp_use_times(self._store)
        entries = [self._store.get(entry_id) for entry_id in unwritten]
        await _answer(message.reply, sum(1 for entry in entries if entry and entry.on_disk and not entry.writing))

    async def _on_lookup_prefix(self, message: LookupPrefix) -> None:
        if message.check_extended and self._store.extended(message.bucket, message.session, message.tokens):
            await _answer(message.reply, PrefixMissed(extended=True))
            return
        # Only a warm-up asks `check_extended`: its lookup is no turn that missed.
        result = self._store.lookup(
            message.bucket, message.session, message.tokens, find_divergence=not message.check_extended
        )
        span = trace.get_current_span()
        span.set_attribute(trace_attributes.SNAPSHOT_MATCHED, result.matched)
        if result.divergence is not None:
            self._record_divergence(report(result.divergence, self._decode, time.time()), span)
        snapshot = result.snapshot
        if snapshot is None:
            await _answer(message.reply, PrefixMissed())
            return
        span.set_attribute(trace_attributes.SNAPSHOT_TIER, "memory" if snapshot.state_held else "disk")
        if snapshot.state_held:
            await _answer(message.reply, _found(result, snapshot.state))
            return
        if not await self._restores.start(message, partial(self._restore, result), wait=False):
            assert self._disk is not None
            self._disk.io.restores_refused += 1
            await _answer(message.reply, PrefixMissed())

    async def _restore(
        self, result: LookupResult, message: LookupPrefix, reply: MemoryObjectSendStream[LookupReply]
    ) -> None:
        """Read the entry's file back (a side task: the inbox goes on meanwhile) and answer with it, or a miss."""
        assert self._disk is not None and result.snapshot is not None
        state = await self._disk.restore(self._store, result.snapshot)
        if state is None:
            await _answer(reply, PrefixMissed())
        elif await _answer(reply, _found(result, state)):
            self._store.count_disk_hit(result.matched)

    def _record_divergence(self, found: DivergenceReport, span: trace.Span) -> None:
        self._divergences.append(found)
        span.set_attribute(trace_attributes.SNAPSHOT_DIVERGED_AT, found.diverged_at)
        span.set_attribute(trace_attributes.SNAPSHOT_CLOSEST_TOKENS, found.closest_tokens)
        span.set_attribute(trace_attributes.SNAPSHOT_CLOSEST_SAME_SESSION, found.same_session)
        span.set_attribute(trace_attributes.SNAPSHOT_DIVERGENCE_BEFORE, found.before)
        span.set_attribute(trace_attributes.SNAPSHOT_DIVERGENCE_PROMPT, found.prompt)
        span.set_attribute(trace_attributes.SNAPSHOT_DIVERGENCE_CACHED, found.cached)

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


def _found(result: LookupResult, state: Any) -> PrefixFound:
    assert result.snapshot is not None
    return PrefixFound(
        state=state,
        length=len(result.snapshot.tokens),
        matched=result.matched,
        trimmed=result.trimmed,
        continues=result.continues,
    )


async def _answer(reply: MemoryObjectSendStream[T], value: T) -> bool:
    """Reply, unless the asker has stopped waiting (the scheduler gives a lookup a deadline): nothing to tell.
    Whether the reply was delivered."""
    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await reply.send(value)
        return True
    return False
