"""StorageActor with a database that can be unreachable: the breaker, its probe, and calls side by side.

The backend is a stand-in for a database server (`RemoteStore`): it serves several
calls at once, can be taken down (every call and probe then raises
`StorageUnreachable`, as PostgreSQL's backend does) and can hold a write until the
test lets it go. It counts the calls that reach it, so "refused at once" means
"refused without reaching the backend".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.storage import StorageActor
from courier.core.failure_codes import FailureCode
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind
from courier.messages.storage import LoadResponse, SaveResponse, StorageMessage
from courier.storage.breaker import Backoff, BreakerState, CircuitBreaker
from courier.storage.faults import StorageFaults
from courier.storage.records import JsonObject, StorageLimits, StorageUnreachable, StoredResponse
from courier.storage.sqlite import SqliteStorage
from tests.actors.test_storage import answer, post
from tests.support.actors import run_actor
from tests.support.records import response

Outbox = MemoryObjectSendStream[StorageMessage]
LIMITS = StorageLimits(max_bytes=10**9, max_entries=10_000, ttl_s=3600.0)
QUICK = Backoff(first_s=0.01, max_s=0.05)
WAIT_S = 5.0  # the bound on anything a test waits for
REFUSED = "Connection refused"


class RemoteStore(SqliteStorage):
    """Responses kept in memory, served up to four calls at once, like a database server's pool."""

    max_concurrent_calls = 4

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, LIMITS)
        self.down = False
        self.calls = 0  # calls that reached the backend
        self.probes = 0
        self.release = threading.Event()  # a held write goes on once this is set
        self.release.set()
        self.holding = threading.Event()  # set once a write is being held
        self._lock = threading.Lock()
        self._records: dict[str, StoredResponse] = {}

    def save_response(self, response: StoredResponse, conversation_items: Sequence[JsonObject]) -> None:
        self._reached()
        self.holding.set()
        assert self.release.wait(WAIT_S)
        self._records[response.id] = response

    def load_response(self, response_id: str) -> StoredResponse | None:
        self._reached()
        return self._records.get(response_id)

    def sweep(self, now: float) -> int:
        self._reached()
        return 0

    def reach(self) -> None:
        with self._lock:
            self.probes += 1
        if self.down:
            raise StorageUnreachable(REFUSED)

    def _reached(self) -> None:
        with self._lock:
            self.calls += 1
        if self.down:
            raise StorageUnreachable(REFUSED)


async def until(condition: Callable[[], bool]) -> None:
    """Wait (at most WAIT_S) until `condition()` holds: it is read between the actor's own steps."""
    with anyio.fail_after(WAIT_S):
        while not condition():
            await anyio.sleep(0.005)


async def load(outbox: Outbox, response_id: str) -> StoredResponse | None:
    return await call(outbox, lambda reply: LoadResponse(response_id=response_id, reply=reply))


@pytest.mark.anyio
async def test_an_unreachable_database_is_refused_at_once_until_a_probe_reaches_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="courier.actors.storage")
    store = RemoteStore(tmp_path)
    faults = StorageFaults(CircuitBreaker(QUICK))
    async with run_actor(StorageActor(store, faults)) as outbox:
        await call(outbox, lambda reply: SaveResponse(response=response("resp_1"), reply=reply))
        store.down = True
        with pytest.raises(Refused) as first:
            await load(outbox, "resp_1")
        assert (first.value.failure.kind, first.value.failure.code) == (
            FailureKind.UNAVAILABLE,
            FailureCode.STORAGE_UNAVAILABLE,
        )
        assert REFUSED in first.value.failure.message
        assert faults.breaker.state is not BreakerState.CLOSED and faults.breaker.trips == 1

        reached = store.calls
        with anyio.fail_after(1):  # refused without a thread, a pool or a timeout
            for _ in range(20):
                with pytest.raises(Refused, match=REFUSED):
                    await load(outbox, "resp_1")
        assert store.calls == reached  # none reached the backend
        await until(lambda: store.probes >= 3)  # the probe keeps trying, backing off, while it is down
        assert not faults.breaker.closed

        store.down = False
        await until(lambda: faults.breaker.closed)
        assert await load(outbox, "resp_1") == response("resp_1")
    assert (faults.breaker.trips, faults.unavailable_calls) == (1, 21)
    logged = [record.getMessage() for record in caplog.records]
    assert sum("the database cannot be reached" in line for line in logged) == 1  # once per outage, not per call
    assert any("the database answers again" in line for line in logged)


@pytest.mark.anyio
async def test_a_slow_write_does_not_hold_up_the_reads_behind_it(tmp_path: Path) -> None:
    store = RemoteStore(tmp_path)
    async with run_actor(StorageActor(store)) as outbox:
        await call(outbox, lambda reply: SaveResponse(response=response("resp_1"), reply=reply))
        store.release.clear()
        store.holding.clear()
        held = post(outbox, lambda reply: SaveResponse(response=response("resp_2"), reply=reply))
        assert await anyio.to_thread.run_sync(store.holding.wait, WAIT_S)
        with anyio.fail_after(WAIT_S / 2):  # served beside the held write, on threads of their own
            for _ in range(store.max_concurrent_calls * 2):
                assert await load(outbox, "resp_1") == response("resp_1")
        assert await load(outbox, "resp_2") is None  # still being written
        store.release.set()
        assert await answer(held) is None
        assert await load(outbox, "resp_2") == response("resp_2")
