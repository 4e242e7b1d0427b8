"""Each tenant's share of the storage budget, on both backends: a write evicts only its own tenant's records.

Tenants are API keys' digests (`tenancy.py`); their records are stored under `tenant/id`.
Budgets here are a few kilobytes, with records of about 3 KB ("big") or a few hundred
bytes ("small"), so a handful of writes reaches them.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import orjson
import pytest

from courier.storage import schema
from courier.storage.records import StorageLimits, StorageRefused, StoredConversation
from courier.storage.sqlite import DATABASE_NAME, SqliteStorage
from courier.storage.tenancy import scoped, shared_limits
from courier.storage.tenant_budget import Usage
from tests.storage.conftest import LIMITS, Clock, OpenStorage, Storage
from tests.support.records import item, response

A, B = "a1b2c3d4e5f60718", "0f1e2d3c4b5a6978"
BIG_TEXT = "x" * 3000
TOTAL = 10_000


def limits(tenant_bytes: int | None = None, tenant_entries: int | None = None) -> StorageLimits:
    """A store of TOTAL bytes and 100 records shared by A and B: evenly unless told otherwise."""
    store = StorageLimits(max_bytes=TOTAL, max_entries=100, ttl_s=3600.0)
    return shared_limits(store, 2, tenant_bytes, tenant_entries)


def big_conversation(storage: Storage, clock: Clock, tenant: str, name: str) -> None:
    clock.now += 1
    conversation = StoredConversation(id=scoped(tenant, name), created_at=1, metadata={})
    storage.create_conversation(conversation, [item(f"msg_{name}", BIG_TEXT)])


def stored(storage: Storage, tenant: str, *names: str) -> list[bool]:
    return [storage.load_conversation(scoped(tenant, name)) is not None for name in names]


def test_a_tenant_writing_past_its_share_evicts_its_own_records_never_anothers(
    open_storage: OpenStorage, clock: Clock
) -> None:
    storage = open_storage(limits())  # 5000 bytes each
    storage.save_response(response(scoped(A, "resp_a")), ())
    storage.create_conversation(StoredConversation(id=scoped(A, "conv_a"), created_at=1, metadata={}), [item("m")])
    a_usage = storage.tenant_usage(A)
    for index in range(4):  # B writes four big records; each past the first takes B past its share
        big_conversation(storage, clock, B, f"conv_b{index}")
        assert storage.tenant_usage(B).bytes <= TOTAL // 2
    assert stored(storage, B, "conv_b0", "conv_b1", "conv_b2", "conv_b3") == [False, False, False, True]
    assert storage.load_response(scoped(A, "resp_a")) is not None
    assert storage.load_conversation(scoped(A, "conv_a")) is not None
    assert storage.tenant_usage(A) == a_usage


def test_a_record_over_its_tenants_share_is_refused_and_evicts_nothing(open_storage: OpenStorage, clock: Clock) -> None:
    storage = open_storage(limits(tenant_bytes=2000))
    storage.save_response(response(scoped(B, "resp_b")), ())
    with pytest.raises(StorageRefused, match="more than this API key's storage budget of 2000"):
        big_conversation(storage, clock, B, "conv_huge")
    assert storage.load_response(scoped(B, "resp_b")) is not None
    assert storage.load_conversation(scoped(B, "conv_huge")) is None


def test_a_write_with_no_room_left_but_another_tenants_is_refused(open_storage: OpenStorage, clock: Clock) -> None:
    storage = open_storage(limits(tenant_bytes=9500))  # shares that add up to more than the store
    for name in ("conv_a0", "conv_a1", "conv_a2"):
        big_conversation(storage, clock, A, name)
    before = (storage.stored_bytes, storage.stored_entries)
    with pytest.raises(StorageRefused, match="other API keys' records, which are never evicted"):
        big_conversation(storage, clock, B, "conv_b0")  # within B's share, but only A's records could make room
    assert stored(storage, A, "conv_a0", "conv_a1", "conv_a2") == [True, True, True]
    assert stored(storage, B, "conv_b0") == [False]
    assert (storage.stored_bytes, storage.stored_entries) == before
    assert storage.tenant_usage(B) == Usage()
    storage.save_response(response(scoped(B, "resp_b")), ())  # what fits is stored
    assert storage.load_response(scoped(B, "resp_b")) is not None


def test_the_record_share_holds_too(open_storage: OpenStorage, clock: Clock) -> None:
    storage = open_storage(limits(tenant_entries=2))
    for index in range(4):
        clock.now += 1
        storage.save_response(response(scoped(B, f"resp_{index}")), ())
    storage.save_response(response(scoped(A, "resp_a")), ())
    assert storage.tenant_usage(B).entries == 2
    assert [storage.load_response(scoped(B, f"resp_{i}")) is not None for i in range(4)] == [False, False, True, True]
    assert storage.load_response(scoped(A, "resp_a")) is not None


def test_a_conversation_grown_past_its_tenants_share_takes_no_more(open_storage: OpenStorage, clock: Clock) -> None:
    storage = open_storage(limits())
    big_conversation(storage, clock, A, "conv_a")
    with pytest.raises(StorageRefused, match="past its storage budget of 5000 bytes"):
        storage.append_conversation_items(scoped(A, "conv_a"), [item("msg_more", BIG_TEXT)])
    assert [entry["id"] for entry in storage.conversation_items(scoped(A, "conv_a")) or ()] == ["msg_conv_a"]


def test_each_tenants_usage_is_counted_as_the_database_holds_it(open_storage: OpenStorage, clock: Clock) -> None:
    storage = open_storage(LIMITS)
    for tenant in (A, B, ""):
        storage.create_conversation(
            StoredConversation(id=scoped(tenant, "conv_1"), created_at=1, metadata={"k": tenant}), [item("m0")]
        )
        storage.save_response(response(scoped(tenant, "resp_1"), conversation=scoped(tenant, "conv_1")), [item("m1")])
        storage.save_response(response(scoped(tenant, "resp_2")), ())
    assert storage.delete_response(scoped(A, "resp_2"))
    assert storage.delete_conversation_item(scoped(B, "conv_1"), "m0")
    assert storage.delete_conversation(scoped("", "conv_1"))
    clock.now += LIMITS.ttl_s + 1
    storage.save_response(response(scoped(B, "resp_3")), ())  # renewed: the sweep keeps it
    assert storage.sweep(clock.now) == 7
    counted = [storage.tenant_usage(tenant) for tenant in (A, B, "")]
    assert counted[0] == Usage() and counted[2] == Usage() and counted[1].entries == 1
    reopened = open_storage(LIMITS)  # SQLite measures the file again; PostgreSQL reads its rows
    assert [reopened.tenant_usage(tenant) for tenant in (A, B, "")] == counted
    assert (reopened.stored_bytes, reopened.stored_entries) == (counted[1].bytes, 1)


def test_a_version_1_sqlite_file_counts_each_tenant_after_its_migration(tmp_path: Path) -> None:
    with closing(sqlite3.connect(tmp_path / DATABASE_NAME, isolation_level=None)) as db:
        db.executescript(schema._SCHEMA)  # version 1: no tenant column
        db.execute("PRAGMA user_version = 1")
        for record_id, nbytes in ((f"{A}/resp_1", 300), (f"{A}/resp_2", 200), ("resp_3", 50)):
            db.execute(
                "INSERT INTO responses VALUES (?, 1, 1, NULL, NULL, '[]', ?, ?)",
                (record_id, orjson.dumps({"id": record_id, "output": []}), nbytes),
            )
    storage = SqliteStorage(tmp_path, LIMITS)
    assert (storage.tenant_usage(A), storage.tenant_usage(""), storage.tenant_usage(B)) == (
        Usage(500, 2),
        Usage(50, 1),
        Usage(),
    )
    storage.close()
    with closing(sqlite3.connect(tmp_path / DATABASE_NAME)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION,)
