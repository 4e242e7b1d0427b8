"""The snapshot store's disk tier at work: one writer, in the order the store asked, and readers beside it.

The store (owned by the snapshot store actor) decides; this carries out its
`WriteFile` / `DeleteFile` effects and reports back, and reads files back for a
lookup that hit an entry only on disk. Nothing here runs on the event loop or the
MLX thread longer than it must: encoding a state is taking byte views of its
arrays (no copy, on the MLX thread), writing and hashing run on a worker thread;
a read maps and verifies the file on a worker thread, and building the arrays back
is the one copy, on the MLX thread. A writer that falls behind refuses new writes
(the entry stays in memory, counted) instead of holding more state; a file that
fails its checks is deleted, counted, and answered as a miss.
"""

from __future__ import annotations

import errno
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from courier.core.snapshot_store import (
    DeleteFile,
    DiskEffect,
    DiskIoCounters,
    EntryId,
    Snapshot,
    SnapshotStore,
    WriteFile,
)
from courier.engine.snapshot_codec import UndecodableState, decode_state, encode_state
from courier.engine.snapshot_directory import SnapshotDirectory
from courier.engine.snapshot_files import SUFFIX, UnreadableSnapshot, read_snapshot, write_snapshot
from courier.runtime import trace_attributes
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import TraceCarrier, carried_span, current_carrier

logger = logging.getLogger(__name__)

READERS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig:
    identity: str
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
        self._disk_full_warned = False

    def adopt(self, store: SnapshotStore) -> int:
        """Index the files an earlier run left (oldest first); delete those that no longer fit. Returns how many
        were adopted."""
        adopted = 0
        for found in self.directory.found:
            header = found.header
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
        return adopted

    def dispatch(self, store: SnapshotStore) -> None:
        """Queue what the store asked of the disk (writes beyond the pending-bytes bound are refused at once)."""
        carrier = current_carrier()
        while effects := store.take_effects():
            for effect in effects:
                if isinstance(effect, WriteFile):
                    nbytes = effect.snapshot.nbytes
                    if self._pending_write_bytes + nbytes > self._config.max_pending_write_bytes and (
                        self._pending_write_bytes > 0
                    ):
                        self.io.writes_refused += 1
                        store.write_failed(effect.snapshot.entry_id, effect.ticket)  # may queue more effects
                        continue
                    self._pending_write_bytes += nbytes
                self._queue.append((effect, carrier))
        if self._queue:
            self._idle = anyio.Event() if self._idle.is_set() else self._idle
            self._wake.set()

    def figures(self) -> DiskIoCounters:
        """A copy of the I/O counters, with the work not done yet."""
        return replace(self.io, pending=len(self._queue) + (0 if self._idle.is_set() else 1))

    async def drained(self) -> None:
        """Wait until every queued write and delete is done."""
        await self._idle.wait()

    async def run_writer(self, store: SnapshotStore) -> None:
        """Carry out the queued effects in order, forever (cancelled with the actor)."""
        while True:
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
        """Read `snapshot`'s file back and hold it in memory again; None (the entry forgotten, its file deleted)
        when the file cannot be used."""
        path = self._paths.get(snapshot.entry_id)
        with carried_span("snapshot_store.restore", current_carrier()) as span:
            span.set_attribute(trace_attributes.SNAPSHOT_FILE_BYTES, snapshot.disk_bytes)
            started = time.monotonic()
            try:
                if path is None:
                    raise UnreadableSnapshot("no file was ever written for it")
                read = await anyio.to_thread.run_sync(read_snapshot, path, self._config.identity, limiter=self._readers)
                try:
                    if read.tokens != snapshot.tokens:
                        raise UnreadableSnapshot(f"{path.name} holds another token vector than its entry")
                    state = await self._mlx.call(partial(decode_state, read.header.layout, read.arrays))
                finally:
                    read.close()
            except (UnreadableSnapshot, UndecodableState, OSError, ValueError, RuntimeError) as error:
                # RuntimeError: MLX refusing the arrays, or its thread too busy to build them
                if store.get(snapshot.entry_id) is None:
                    return None  # superseded or evicted while it was read: its file went with it
                self.io.read_errors += 1
                span.set_attribute(trace_attributes.FAILURE, str(error))
                logger.warning("prompt cache: dropping an unusable snapshot file: %s", error)
                store.drop_unreadable(snapshot.entry_id)
                self.dispatch(store)
                return None
            self.io.reads += 1
            self.io.read_bytes += snapshot.nbytes
            self.io.read_seconds += time.monotonic() - started
            store.promote(snapshot.entry_id, state)
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
                        identity=self._config.identity,
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
                span.set_attribute(trace_attributes.FAILURE, str(error))
                self._warn_write_failed(error)
                store.write_failed(snapshot.entry_id, effect.ticket)
                return
            span.set_attribute(trace_attributes.SNAPSHOT_FILE_BYTES, size)
        self._disk_full_warned = False
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
