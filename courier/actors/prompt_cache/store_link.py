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


async def ask_store(
    caching: PromptCaching,
    stats: SchedulerStats,
    *,
    session: str,
    tokens: tuple[int, ...],
    trace: TraceCarrier,
    bucket: Bucket,
    timeout_s: float,
    check_extended: bool = False,
) -> LookupReply | None:
    """The store's answer, or None (a miss) when it is busy, stopped, or silent past `timeout_s`."""
    try:
        with anyio.move_on_after(timeout_s):
            found: LookupReply = await ask(
                caching.store,
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
    stats.lookups_timed_out += 1  # nor one that answers too late: the batch does not wait
    return None


def tell_store(
    caching: PromptCaching,
    stats: SchedulerStats,
    *,
    session: str,
    snapshot: SnapshotTaken,
    trace: TraceCarrier,
    bucket: Bucket,
) -> None:
    """Hand the store a snapshot the engine took, without waiting."""
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
        caching.store.send_nowait(message)
    except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
        stats.snapshots_dropped += 1  # a busy store loses a snapshot, never delays generation


def cached_prefix(found: LookupReply | None) -> CachedPrefix | None:
    """What a lookup found, as the engine takes it (None: a miss)."""
    if not isinstance(found, PrefixFound):
        return None
    return CachedPrefix(state=found.state, length=found.length, matched=found.matched, continues=found.continues)
