"""StorageActor: owns the response/conversation database; every call runs on a worker thread.

Serves as many `StorageRequest`s at once as the backend takes
(`ResponseStorage.max_concurrent_calls`): SQLite one, so its writes stay serialized
in arrival order; PostgreSQL its pool's size, so one slow call does not hold up every
reader behind it. Each call goes to a worker thread, so the database never blocks the
event loop. Every fault the backend types stays with the request that met it, and the
actor keeps serving:

- a record over the whole budget: 400 `storage_budget_exceeded`; one the backend
  cannot hold at all (`UnstorableRecord`): 400 `unstorable_content`; an unknown
  pagination cursor: 400 on `after`;
- a damaged record (`DamagedRecord`): 500 `stored_record_damaged` for each request
  that reads it; logged once per record with its id;
- a database it cannot use right now (`StorageUnavailable`: a full disk, an I/O
  error, a PostgreSQL server slow to answer): 503 `storage_unavailable`; logged
  when it starts failing and when a write succeeds again, which it does by itself
  once the disk has room;
- a database it cannot reach (`StorageUnreachable`: PostgreSQL down, or not reached
  since start-up): 503 too, and the breaker (`storage/breaker.py`) opens: every
  request after it is refused at once, without a thread or a wait, while a probe
  task tries to connect with backoff; the first probe that connects closes it.

`storage_faults` counts them (`storage/faults.py`) and holds the breaker, for
`/metrics`. A periodic tick removes records past their TTL; a tick the database
cannot serve (or that finds the breaker open) is tried again at the next one.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from courier.core.failure_codes import FailureCode
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.storage import StorageMessage
from courier.runtime.actor import Actor
from courier.runtime.concurrent_actor import SideTasks
from courier.storage.faults import StorageFaults
from courier.storage.paging import UnknownCursor
from courier.storage.records import (
    DamagedRecord,
    ResponseStorage,
    StorageRefused,
    StorageUnavailable,
    StorageUnreachable,
    UnstorableRecord,
)

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0


class StorageActor(Actor[StorageMessage]):
    name = "storage"

    def __init__(self, storage: ResponseStorage, faults: StorageFaults | None = None) -> None:
        self._storage = storage
        self.storage_faults = faults if faults is not None else StorageFaults()
        self._breaker = self.storage_faults.breaker
        concurrent = storage.max_concurrent_calls
        # As many threads touch the database at once as it serves calls (the sweep shares them).
        self._limiter = anyio.CapacityLimiter(concurrent)
        self._calls: SideTasks[StorageMessage] = SideTasks(concurrent, self.fault)
        self._tripped = anyio.Event()  # set when the breaker opens: the probe task wakes

    async def setup(self) -> None:
        await self._sweep()

    async def background(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._calls.run)
            task_group.start_soon(self._sweep_periodically)
            task_group.start_soon(self._probe_while_open)

    def stopped(self) -> None:
        self._storage.close()

    async def handle(self, message: StorageMessage) -> None:
        if not self._breaker.closed:  # known unreachable: no thread, no wait
            _answer(message.reply, self._refused_while_open())
            return
        await self._calls.start(message, self._serve, wait=True)

    async def _serve(self, message: StorageMessage, reply: MemoryObjectSendStream[Any]) -> None:
        result: Any
        try:
            if not self._breaker.closed:  # it opened while this call waited for a free slot
                result = self._refused_while_open()
            else:
                result = await self._call(message.apply, self._storage)
        except StorageRefused as error:
            result = RequestFailed(
                kind=FailureKind.INVALID_REQUEST, message=str(error), code=FailureCode.STORAGE_BUDGET_EXCEEDED
            )
        except UnstorableRecord as error:
            result = RequestFailed(
                kind=FailureKind.INVALID_REQUEST, message=str(error), code=FailureCode.UNSTORABLE_CONTENT
            )
        except UnknownCursor as error:
            result = RequestFailed(
                kind=FailureKind.INVALID_REQUEST,
                message=f"no item with id '{error.args[0]}' in this list",
                param="after",
            )
        except DamagedRecord as error:
            result = self._damaged(error)
        except StorageUnreachable as error:
            self._trip(error)
            result = self._unavailable(error, log=False)
        except StorageUnavailable as error:
            result = self._unavailable(error)
        else:
            if message.writes:
                self._written()
        # Without a checkpoint: a call the database served is answered even when the actor is being stopped.
        _answer(reply, result)

    async def _sweep_periodically(self) -> None:
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            await self._sweep()

    async def _probe_while_open(self) -> None:
        """Each time the breaker opens: probe with backoff until the database answers, then close it."""
        while True:
            await self._tripped.wait()
            self._tripped = anyio.Event()
            opened = time.monotonic()
            while not self._breaker.closed:
                await anyio.sleep(self._breaker.probe_delay_s)
                self._breaker.probing()
                try:
                    await anyio.to_thread.run_sync(self._storage.reach)  # beside the calls' threads: none is waiting
                except StorageUnavailable as error:
                    self._breaker.probe_failed(str(error))
                else:
                    self._breaker.probe_succeeded()
            logger.info(
                "storage: the database answers again after %.1f s; requests that need storage are served",
                time.monotonic() - opened,
            )

    async def _sweep(self) -> None:
        if not self._breaker.closed:
            return
        try:
            await self._call(self._storage.sweep, time.time())
        except StorageUnreachable as error:
            self._trip(error)
        except StorageUnavailable as error:
            self._unavailable(error)
        else:
            self._written()

    def _trip(self, error: StorageUnreachable) -> None:
        if self._breaker.trip(str(error)):
            logger.error(
                "storage: the database cannot be reached (%s); requests that need it fail at once with 503 until a "
                "probe reaches it",
                error,
            )
            self._tripped.set()

    def _refused_while_open(self) -> RequestFailed:
        self.storage_faults.unavailable()
        return self._failure(self._breaker.reason)

    def _damaged(self, error: DamagedRecord) -> RequestFailed:
        if self.storage_faults.damaged(error.record):
            logger.error("storage: %s; requests that read it fail, everything else is served", error)
        return RequestFailed(
            kind=FailureKind.INTERNAL,
            message=f"the stored {error.record} is damaged and cannot be read",
            code=FailureCode.STORED_RECORD_DAMAGED,
        )

    def _unavailable(self, error: StorageUnavailable, *, log: bool = True) -> RequestFailed:
        if self.storage_faults.unavailable() and log:
            logger.error("storage: the database cannot be used (%s); requests that need it fail with 503", error)
        return self._failure(str(error))

    def _failure(self, reason: str) -> RequestFailed:
        return RequestFailed(
            kind=FailureKind.UNAVAILABLE,
            message=f"response storage is unavailable ({reason}); nothing was changed, retry later",
            code=FailureCode.STORAGE_UNAVAILABLE,
        )

    def _written(self) -> None:
        if failures := self.storage_faults.written():
            logger.info("storage: writes succeed again, after %d calls failed", failures)

    async def _call(self, function: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)


def _answer(reply: MemoryObjectSendStream[Any], result: Any) -> None:
    # An asker that left meanwhile (a client that disconnected) is no fault of storage's.
    with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
        reply.send_nowait(result)
