"""The snapshot store's disk tier at work: one writer, in the order the store asked, and readers beside it.

The store (owned by the snapshot store actor) decides; this carries out its
`WriteFile` / `DeleteFile` effects and reports back, and reads files back for a
lookup that hit an entry only on disk. Nothing here runs on the event loop or the
MLX thread longer than it must: encoding a state is taking byte views of its
arrays (no copy, on the MLX thread), writing and hashing run on a worker thread;
a read loads and verifies the file on a worker thread, and building the arrays back
from those bytes is the one copy on the MLX thread. A writer that falls behind refuses new writes
(the entry stays in memory, counted) instead of holding more state, once the writes
it holds for superseded entries have given up their room; a file that
fails its checks is deleted, counted, and answered as a miss.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from courier.core.prompt_cache.entries import (
    Bucket,
    DeleteFile,
    DiskEffect,
    EntryId,
    Snapshot,
    WriteFile,
    disk_footprint,
)
from courier.core.prompt_cache.rejections import FileRejection
from courier.core.prompt_cache.stats import DiskIoCounters
from courier.core.prompt_cache.store import SnapshotStore
from courier.engine.prompt_cache.codec import UndecodableState, decode_state, encode_state
from courier.engine.prompt_cache.directory import SnapshotDirectory
from courier.engine.prompt_cache.files import SUFFIX, UnreadableSnapshot, read_snapshot, write_snapshot
from courier.runtime import trace_attributes
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import TraceCarrier, carried_span, current_carrier

logger = logging.getLogger(__name__)

READERS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig:
    # Bytes of state the writer may hold for writes not done yet; beyond, a write is refused (memory only).
    max_pending_write_bytes: int


class SnapshotDisk:
    def __init__(self, directory: SnapshotDirectory, config: DiskTierConfig, mlx: MlxThread) -> None:
        self.directory = directory
        self.io = DiskIoCounters()
        self._config = config
        self._mlx = mlx
        self._queue: deque[tuple[DiskEffect, TraceCarrier]] = deque()
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._paths: dict[EntryId, Path] = {}
        self._pending_write_bytes = 0
        self._readers = anyio.CapacityLimiter(READERS)
        self._restoring: dict[EntryId, _Restore] = {}
        self._disk_full_warned = False
        # Whether the last write succeeded: only then does an idle writer catch up on refused writes (a full disk
        # is not retried in a loop; the next snapshot's own write tries again).
        self._writes_healthy = True

    def adopt(self, store: SnapshotStore, served: Bucket) -> int:
        """Index the files an earlier run left (oldest first); delete those that no longer fit, and those of another
        served model name or chat template (`served`), which no lookup could ever match. Returns how many were
        adopted."""
        adopted = 0
        for found in self.directory.found:
            header = found.header
            if (header.bucket.model_id, header.bucket.template_signature) != (
                served.model_id,
                served.template_signature,
            ):
                found.path.unlink(missing_ok=True)
                continue
            entry_id = store.adopt(
                bucket=header.bucket,
                session=header.session,
                origin=header.origin,
                tokens=found.tokens,
                nbytes=header.nbytes,
                prompt_length=header.prompt_length,
                age_s=found.age_s,
            )
            if entry_id is None:
                found.path.unlink(missing_ok=True)
                continue
            self._paths[entry_id] = found.path
            adopted += 1
        self.directory.found.clear()
        store.counters.disk_unreadable += self.directory.unreadable  # deleted while the directory was opened
        for reason, count in self.directory.rejected.items():
            self._count_rejected(reason, count)
        return adopted

    def dispatch(self, store: SnapshotStore, *, bounded: bool = True) -> None:
        """Queue what the store asked of the disk (writes beyond the pending-bytes bound are refused at once, unless
        not `bounded`: a flush before stopping, whose states memory holds anyway)."""
        carrier = current_carrier()
        while effects := store.take_effects():
            for effect in effects:
                if isinstance(effect, WriteFile):
                    nbytes = effect.snapshot.nbytes
                    # A spill (memory has let go of the entry: refusing it loses it) gets twice the room of a write
                    # behind an entry memory still holds (refused, it is caught up on later, or spilled).
                    limit = self._config.max_pending_write_bytes * (1 if effect.snapshot.in_memory else 2)
                    if bounded and self._pending_write_bytes + nbytes > limit:
                        self._drop_unwanted_writes(store)  # they give up their room before anything is refused
                    over = self._pending_write_bytes + nbytes > limit
                    if bounded and over and self._pending_write_bytes > 0:
                        self.io.writes_refused += 1
                        store.write_failed(effect.snapshot.entry_id, effect.ticket)  # may queue more effects
                        continue
                    self._pending_write_bytes += nbytes
                self._queue.append((effect, carrier))
        if self._queue:
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            self._wake.set()

    def _drop_unwanted_writes(self, store: SnapshotStore) -> None:
        """Skip now the queued writes whose entries were superseded or evicted while they waited (the writer would
        skip them on its turn): until then their bytes would refuse writes still wanted, and a refused spill loses
        its conversation."""
        kept: deque[tuple[DiskEffect, TraceCarrier]] = deque()
        for effect, carrier in self._queue:
            if isinstance(effect, WriteFile) and not store.wants_file(effect.snapshot.entry_id, effect.ticket):
                self._pending_write_bytes -= effect.snapshot.nbytes
                self.io.writes_skipped += 1
                continue
            kept.append((effect, carrier))
        self._queue = kept

    def figures(self) -> DiskIoCounters:
        """A copy of the I/O counters, with the work not done yet."""
        pending = len(self._queue) + (0 if self._idle.is_set() else 1)
        return replace(self.io, pending=pending, files_rejected=dict(self.io.files_rejected))

    def _count_rejected(self, reason: FileRejection, count: int = 1) -> None:
        self.io.files_rejected[reason] = self.io.files_rejected.get(reason, 0) + count

    async def stamp_use_times(self, store: SnapshotStore) -> None:
        """Set each file's modification time to its entry's last use (memory hits never touch the file), so the
        next start ages it right."""
        now = time.time()
        stamps = [(self._paths[key], now - age) for key, age in store.disk_ages() if key in self._paths]
        await anyio.to_thread.run_sync(_stamp, stamps)

    async def drained(self) -> None:
        """Wait until every queued write and delete is done."""
        await self._idle.wait()

    async def run_writer(self, store: SnapshotStore) -> None:
        """Carry out the queued effects in order, forever (cancelled with the actor)."""
        while True:
            if not self._queue and self._writes_healthy and store.flush(evict=False):
                self.dispatch(store)  # idle: catch up on writes refused while it was busy (kill -9 keeps them too)
            if not self._queue:
                self._idle.set()
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            effect, carrier = self._queue.popleft()
            try:
                if isinstance(effect, WriteFile):
                    try:
                        await self._write(store, effect, carrier)
                    finally:
                        self._pending_write_bytes -= effect.snapshot.nbytes
                else:
                    await self._delete(effect)
            except Exception as error:  # one file's trouble never stops the writer (or the store)
                logger.error("prompt cache: the disk writer failed on %s: %r", type(effect).__name__, error)
                if isinstance(effect, WriteFile):
                    store.write_failed(effect.snapshot.entry_id, effect.ticket)
            self.dispatch(store)

    async def restore(self, store: SnapshotStore, snapshot: Snapshot) -> Any | None:
        """Read `snapshot`'s file back and hold it in memory again; None (a miss) when it cannot be. One read per
        entry at a time: a second lookup of an entry being read waits for that read."""
        entry_id = snapshot.entry_id
        pending = self._restoring.get(entry_id)
        if pending is not None:
            await pending.done.wait()
            return pending.state
        pending = self._restoring[entry_id] = _Restore()
        try:
            pending.state = await self._read_back(store, snapshot)
            return pending.state
        finally:
            del self._restoring[entry_id]
            pending.done.set()

    async def _read_back(self, store: SnapshotStore, snapshot: Snapshot) -> Any | None:
        entry_id = snapshot.entry_id
        path = self._paths.get(entry_id)
        with carried_span("snapshot_store.restore", current_carrier()) as span:
            started = time.monotonic()
            try:
                if path is None:
                    raise FileNotFoundError(f"no file for entry {entry_id}")
                charged = disk_footprint(snapshot.nbytes, len(snapshot.tokens))
                read = await anyio.to_thread.run_sync(
                    read_snapshot, path, self.directory.trust, charged, limiter=self._readers
                )
                try:
                    if read.tokens != snapshot.tokens:
                        raise UnreadableSnapshot(f"{path.name} holds another token vector than its entry")
                    state = await self._mlx.call(partial(decode_state, read.header.layout, read.arrays))
                finally:
                    read.close()
            except (UnreadableSnapshot, UndecodableState) as error:
                self.io.read_errors += 1
                self._count_rejected(error.reason if isinstance(error, UnreadableSnapshot) else FileRejection.LAYOUT)
                span.set_attribute(trace_attributes.FAILURE, str(error))
                # Forget the entry only if this is still its file and the state is nowhere else.
                if store.get(entry_id) is snapshot and not snapshot.state_held and self._paths.get(entry_id) == path:
                    logger.warning("prompt cache: deleting an unusable snapshot file: %s", error)
                    store.drop_unreadable(entry_id)
                    self.dispatch(store)
                return None
            except (OSError, RuntimeError) as error:
                # Gone meanwhile (superseded, evicted), or a passing trouble (too many open files, the MLX thread
                # busy): a miss, counted; the file stays for the next lookup.
                self.io.read_errors += 1
                span.set_attribute(trace_attributes.FAILURE, f"{type(error).__name__}: {error}")
                return None
            self.io.reads += 1
            self.io.read_bytes += snapshot.nbytes
            self.io.read_seconds += time.monotonic() - started
            store.promote(entry_id, state)
            self.dispatch(store)
            return state

    async def _write(self, store: SnapshotStore, effect: WriteFile, carrier: TraceCarrier) -> None:
        snapshot = effect.snapshot
        if not store.wants_file(snapshot.entry_id, effect.ticket):
            self.io.writes_skipped += 1  # superseded or evicted while it waited: nothing to keep
            return
        path = self.directory.path / f"{uuid.uuid4().hex}{SUFFIX}"
        with carried_span("snapshot_store.spill", carrier) as span:
            span.set_attribute(trace_attributes.SNAPSHOT_TIER, "disk")
            started = time.monotonic()
            try:
                encoded = await self._mlx.call(partial(encode_state, effect.state))
                if not store.wants_file(snapshot.entry_id, effect.ticket):
                    self.io.writes_skipped += 1  # superseded while it was encoded
                    return
                size = await anyio.to_thread.run_sync(
                    partial(
                        write_snapshot,
                        path,
                        trust=self.directory.trust,
                        bucket=snapshot.bucket,
                        session=snapshot.session,
                        origin=snapshot.origin,
                        prompt_length=snapshot.prompt_length,
                        tokens=snapshot.tokens,
                        encoded=encoded,
                        max_bytes=effect.max_bytes,
                    )
                )
            except (OSError, ValueError, TypeError) as error:
                self.io.write_errors += 1
                self._writes_healthy = False
                span.set_attribute(trace_attributes.FAILURE, str(error))
                self._warn_write_failed(error)
                store.write_failed(snapshot.entry_id, effect.ticket)
                return
            span.set_attribute(trace_attributes.SNAPSHOT_FILE_BYTES, size)
        self._disk_full_warned = False
        self._writes_healthy = True
        self.io.writes += 1
        self.io.write_bytes += size
        self.io.write_seconds += time.monotonic() - started
        self._paths[snapshot.entry_id] = path
        store.write_done(snapshot.entry_id, effect.ticket)
        # else: dropped while it was written; its DeleteFile is queued behind this write and removes it

    async def _delete(self, effect: DeleteFile) -> None:
        path = self._paths.pop(effect.entry_id, None)
        if path is not None:
            await anyio.to_thread.run_sync(partial(path.unlink, missing_ok=True))

    def _warn_write_failed(self, error: Exception) -> None:
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        if full and not self._disk_full_warned:
            self._disk_full_warned = True  # once until a write succeeds again
            logger.warning(
                "prompt cache: the disk under %s is full; snapshots stay in memory only until space frees up (%s)",
                self.directory.path,
                error,
            )
        elif not full:
            logger.warning("prompt cache: a snapshot could not be written to disk: %s", error)


def _stamp(stamps: list[tuple[Path, float]]) -> None:
    for path, used in stamps:
        with suppress(OSError):
            os.utime(path, (used, used), follow_symlinks=False)


@dataclass(slots=True)
class _Restore:
    """A file being read back, for the lookups that ask for the same entry meanwhile."""

    done: anyio.Event = field(default_factory=anyio.Event)
    state: Any | None = None
