"""StorageActor: owns the response/conversation database; every call runs on one worker thread.

Handles one `StorageRequest` at a time, so writes are serialized, and hands each
to a dedicated thread, so SQLite never blocks the event loop. A refused write (a
record over the whole budget) or an unknown pagination cursor becomes a
`RequestFailed`; anything else escaping the backend is a genuine fault and stops
the server loudly. A periodic tick removes records past their TTL.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.to_thread

from courier.core.failure_codes import FailureCode
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.storage import StorageMessage
from courier.runtime.actor import Actor
from courier.storage.paging import UnknownCursor
from courier.storage.records import ResponseStorage, StorageRefused

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 60.0


class StorageActor(Actor[StorageMessage]):
    name = "storage"

    def __init__(self, storage: ResponseStorage) -> None:
        self._storage = storage
        # One thread at a time touches the database connection.
        self._limiter = anyio.CapacityLimiter(1)

    async def setup(self) -> None:
        await self._call(self._storage.sweep, time.time())

    async def background(self) -> None:
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            await self._call(self._storage.sweep, time.time())

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
        except UnknownCursor as error:
            result = RequestFailed(
                kind=FailureKind.INVALID_REQUEST,
                message=f"no item with id '{error.args[0]}' in this list",
                param="after",
            )
        await message.reply.send(result)

    async def _call(self, function: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(function, *args, limiter=self._limiter)
