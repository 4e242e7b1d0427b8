"""StorageActor: owns the response/conversation database; every call runs on one worker thread.

Handles one `StorageRequest` at a time, so writes are serialized, and hands each
to a dedicated thread, so SQLite never blocks the event loop. Every fault the
backend types stays with the request that met it, and the actor keeps serving:

- a record over the whole budget: 400 `storage_budget_exceeded`; one the backend
  cannot hold at all (`UnstorableRecord`): 400 `unstorable_content`; an unknown
  pagination cursor: 400 on `after`;
- a damaged record (`DamagedRecord`): 500 `stored_record_damaged` for each request
  that reads it; logged once per record with its id;
- a database it cannot use right now (`StorageUnavailable`: a full disk, an I/O
  error, a PostgreSQL server down, slow, or not reached since start-up): 503
  `storage_unavailable`; logged when it starts failing and when a write
  succeeds again, which it does by itself once the disk has room.

`storage_faults` counts them (`storage/faults.py`) for `/metrics`. A periodic tick
removes records past their TTL; a tick the database cannot serve is tried again at
the next one.
"""

from __future__ import annotations

import logging
import time
from contextlib import suppress
from typing import Any

import anyio
import anyio.to_thread

from courier.core.failure_codes import FailureCode
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.storage import StorageMessage
from courier.runtime.actor import Actor
from courier.storage.faults import StorageFaults
from courier.storage.paging import UnknownCursor
from courier.storage.records import (
    DamagedRecord,
    ResponseStorage,
    StorageRefused,
    StorageUnavailable,
    UnstorableRecord,
)

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0


class StorageActor(Actor[StorageMessage]):
    name = "storage"

    def __init__(self, storage: ResponseStorage, faults: StorageFaults | None = None) -> None:
        self._storage = storage
        # One thread at a time touches the database connection.
        self._limiter = anyio.CapacityLimiter(1)
        self.storage_faults = faults if faults is not None else StorageFaults()

    async def setup(self) -> None:
        await self._sweep()

    async def background(self) -> None:
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            await self._sweep()

    def stopped(self) -> None:
        self._storage.close()

    async def handle(self, message: StorageMessage) -> None:
        result: Any
        try:
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
        except StorageUnavailable as error:
            result = self._unavailable(error)
        else:
            if message.writes:
                self._written()
        # An asker that left meanwhile (a client that disconnected) is no fault of storage's.
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await message.reply.send(result)

    async def _sweep(self) -> None:
        try:
            await self._call(self._storage.sweep, time.time())
        except StorageUnavailable as error:
            self._unavailable(error)
        else:
            self._written()

    def _damaged(self, error: DamagedRecord) -> RequestFailed:
        if self.storage_faults.damaged(error.record):
            logger.error("storage: %s; requests that read it fail, everything else is served", error)
        return RequestFailed(
            kind=FailureKind.INTERNAL,
            message=f"the stored {error.record} is damaged and cannot be read",
            code=FailureCode.STORED_RECORD_DAMAGED,
        )

    def _unavailable(self, error: StorageUnavailable) -> RequestFailed:
        if self.storage_faults.unavailable():
            logger.error("storage: the database cannot be used (%s); requests that need it fail with 503", error)
        return RequestFailed(
            kind=FailureKind.UNAVAILABLE,
            message=f"response storage is unavailable ({error}); nothing was changed, retry later",
            code=FailureCode.STORAGE_UNAVAILABLE,
        )

    def _written(self) -> None:
        if failures := self.storage_faults.written():
            logger.info("storage: writes succeed again, after %d calls failed", failures)

    async def _call(self, function: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)
