"""The storage backends under test: every test that asks for `open_storage` runs against SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from courier.storage.postgres import PostgresStorage
from courier.storage.records import StorageLimits
from courier.storage.sqlite import SqliteStorage
from tests.support.postgres_cluster import PostgresCluster

LIMITS = StorageLimits(max_bytes=10**9, max_entries=10_000, ttl_s=3600.0)
BACKENDS = ("sqlite", "postgresql")

Storage = SqliteStorage | PostgresStorage
# Opens the test's own database (the same one each time it is called) with these limits.
OpenStorage = Callable[[StorageLimits], Storage]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=BACKENDS)
def open_storage(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[OpenStorage]:
    opened: list[Storage] = []
    if request.param == "postgresql":
        cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
        url = cluster.fresh_url()

    def open_storage(limits: StorageLimits = LIMITS) -> Storage:
        store: Storage
        if request.param == "postgresql":
            store = PostgresStorage(url, limits, clock=clock)
        else:
            store = SqliteStorage(tmp_path, limits, clock=clock)
        opened.append(store)
        return store

    yield open_storage
    for store in opened:
        store.close()


@pytest.fixture
def storage(open_storage: OpenStorage) -> Storage:
    return open_storage(LIMITS)
