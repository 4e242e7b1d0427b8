"""The scheduler's side of the prompt cache: which bucket a request's snapshots belong to, asking the snapshot store
for a prefix (`LookupPrefix`) and telling it the snapshots the engine takes (`InsertSnapshot`).

A store that cannot answer in time is a miss and a store too busy to take a snapshot loses it: neither ever fails a
request or delays the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from courier.core.prompt_cache.entries import Bucket
from courier.engine.engine_io import SnapshotTaken
from courier.engine.model_state import CachedPrefix
from courier.messages.snapshot_store import InsertSnapshot, LookupPrefix, LookupReply, PrefixFound, SnapshotStoreMessage
from courier.runtime.actor import ActorBusy, ActorStopped, ask
from courier.runtime.tracing import TraceCarrier
from courier.status.scheduler_stats import SchedulerStats

# How long a request waits for its prefix lookup before it runs without a cached prefix (a miss, counted). The
# lookup runs beside the batch, so only the request itself waits: a store busy behind other work, or reading a
# large snapshot back from disk, holds up no one else's decode steps.
STORE_LOOKUP_TIMEOUT_S = 2.0
# An idle warm-up's lookup waits in the drive loop itself (live requests arriving meanwhile wait for it): shorter.
WARM_UP_LOOKUP_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCaching:
    """Where snapshots live and which bucket this model's snapshots belong to."""

    store: MemoryObjectSendStream[SnapshotStoreMessage]
    bucket: Bucket

    def bucket_for(self, media_digest: str, tenant: str) -> Bucket:
        """The bucket of a request with these images (their digest) and this tenant."""
        return replace(self.bucket, media_digest=media_digest, tenant=tenant)


class StoreLink:
    """The scheduler's link to the snapshot store: disabled (every lookup a miss, every snapshot kept nowhere) when
    the model runs without prompt caching."""

    def __init__(self, caching: PromptCaching | None, stats: SchedulerStats, *, lookup_timeout_s: float) -> None:
        self._caching = caching
        self._stats = stats
        self._lookup_timeout_s = lookup_timeout_s

    @property
    def enabled(self) -> bool:
        return self._caching is not None

    @property
    def lookup_timeout_s(self) -> float:
        return self._lookup_timeout_s

    def bucket(self, media_digest: str, tenant: str) -> Bucket | None:
        """The bucket of a request with these images (their digest) and this tenant (None: no caching)."""
        return self._caching.bucket_for(media_digest, tenant) if self._caching is not None else None

    async def look_up(
        self,
        session: str,
        tokens: tuple[int, ...],
        trace: TraceCarrier,
        bucket: Bucket | None,
        *,
        check_extended: bool = False,
        timeout_s: float | None = None,
    ) -> LookupReply | None:
        """The store's answer, or None (a miss) without caching, or when the store is busy, stopped, or silent past
        `timeout_s` (default: the lookup timeout)."""
        if self._caching is None or bucket is None:
            return None
        store = self._caching.store
        try:
            with anyio.move_on_after(self._lookup_timeout_s if timeout_s is None else timeout_s):
                found: LookupReply = await ask(
                    store,
                    lambda reply: LookupPrefix(
                        trace=trace,
                        bucket=bucket,
                        session=session,
                        tokens=tokens,
                        reply=reply,
                        check_extended=check_extended,
                    ),
                )
                return found
        except (ActorBusy, ActorStopped):
            return None  # a cache that cannot answer is a miss, never a failure
        self._stats.lookups_timed_out += 1  # nor one that answers too late: the batch does not wait
        return None

    def insert(self, session: str, snapshot: SnapshotTaken, trace: TraceCarrier, bucket: Bucket | None) -> None:
        """Hand the store a snapshot the engine took, without waiting (nothing without caching)."""
        if self._caching is None or bucket is None:
            return
        message = InsertSnapshot(
            trace=trace,
            bucket=bucket,
            session=session,
            origin=snapshot.origin,
            tokens=snapshot.tokens,
            state=snapshot.state,
            nbytes=snapshot.nbytes,
            continues=snapshot.continues,
            prompt_length=snapshot.prompt_length,
        )
        try:
            self._caching.store.send_nowait(message)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._stats.snapshots_dropped += 1  # a busy store loses a snapshot, never delays generation


def cached_prefix(found: LookupReply | None) -> CachedPrefix | None:
    """What a lookup found, as the engine takes it (None: a miss)."""
    if not isinstance(found, PrefixFound):
        return None
    return CachedPrefix(state=found.state, length=found.length, matched=found.matched, continues=found.continues)
