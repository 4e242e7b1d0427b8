"""Tenants' key spaces: a record stored for one tenant is not there for another, nor for an id naming its key."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from courier.messages.storage import LoadChain, LoadResponse, SaveResponse
from courier.storage.records import StorageLimits, StoredResponse
from courier.storage.tenancy import oversubscribed, scoped, shared_limits, tenant_of, unscoped
from tests.storage.conftest import OpenStorage
from tests.support.records import response

ONE, TWO = "a1b2c3d4e5f60718", "0f1e2d3c4b5a6978"
# `apply` runs a message against the backend directly (the storage actor's part): its reply stream goes unused.
NO_REPLY, _UNUSED = anyio.create_memory_object_stream[Any](1)
NO_REPLY.close()
_UNUSED.close()


@pytest.mark.parametrize(
    ("tenant", "record_id", "key"),
    [
        ("", "resp_1", "resp_1"),  # no keys: ids as they are
        (ONE, "resp_1", f"{ONE}/resp_1"),
        (ONE, f"{TWO}/resp_1", f"\x00{TWO}/resp_1"),  # naming another tenant's key reaches nothing
        ("", f"{TWO}/resp_1", f"\x00{TWO}/resp_1"),
    ],
)
def test_scoped_keys(tenant: str, record_id: str, key: str) -> None:
    assert scoped(tenant, record_id) == key
    if "/" not in record_id:
        assert unscoped(tenant, key) == record_id


def test_a_tenants_records_are_its_own(open_storage: OpenStorage) -> None:
    storage = open_storage(StorageLimits(max_bytes=1 << 20, max_entries=100, ttl_s=3600.0))
    try:
        SaveResponse(response=response("resp_1"), tenant=ONE, reply=NO_REPLY).apply(storage)
        SaveResponse(response=response("resp_2", previous="resp_1"), tenant=ONE, reply=NO_REPLY).apply(storage)

        def load(record_id: str, tenant: str) -> StoredResponse | None:
            return LoadResponse(response_id=record_id, tenant=tenant, reply=NO_REPLY).apply(storage)

        mine = load("resp_1", ONE)
        assert mine is not None and mine.id == "resp_1"
        assert load("resp_1", TWO) is None
        assert load("resp_1", "") is None
        assert load(f"{ONE}/resp_1", "") is None  # the stored key, named outright, is not an id anyone has
        chain = LoadChain(response_id="resp_2", tenant=ONE, reply=NO_REPLY).apply(storage)
        assert chain is not None and [r.id for r in chain.responses] == ["resp_1", "resp_2"]
        assert chain.responses[1].previous_response_id == "resp_1"
        assert LoadChain(response_id="resp_2", tenant=TWO, reply=None).apply(storage) is None  # type: ignore[arg-type]
    finally:
        storage.close()


STORE = StorageLimits(max_bytes=1000, max_entries=10, ttl_s=60.0)


@pytest.mark.parametrize(
    ("tenants", "max_bytes", "max_entries", "shares"),
    [
        (0, None, None, (1000, 10)),  # no keys: the anonymous tenant may use it all
        (1, None, None, (1000, 10)),
        (3, None, None, (333, 3)),  # an even share of each budget
        (20, None, None, (50, 1)),  # never less than one record
        (3, 600, 8, (600, 8)),  # as the operator sets them, even adding up to more than the store
        (3, 5000, 50, (1000, 10)),  # never more than the whole store
    ],
)
def test_each_tenants_share(
    tenants: int, max_bytes: int | None, max_entries: int | None, shares: tuple[int, int]
) -> None:
    limits = shared_limits(STORE, tenants, max_bytes, max_entries)
    assert (limits.tenant_bytes, limits.tenant_entries) == shares
    assert (limits.max_bytes, limits.max_entries, limits.ttl_s) == (1000, 10, 60.0)


@pytest.mark.parametrize(
    ("tenants", "max_bytes", "max_entries", "over"),
    [
        (1, 5000, 50, None),  # one key: no one else to learn of
        (3, None, None, None),  # even shares fit
        (3, 600, None, "3 x 600 bytes > 1000"),  # shares past the store: a key could learn what others hold
        (3, None, 8, "3 x 8 records > 10"),
        (20, None, None, "20 x 1 records > 10"),  # never less than one record, even past the store
    ],
)
def test_shares_past_the_store_are_named(
    tenants: int, max_bytes: int | None, max_entries: int | None, over: str | None
) -> None:
    warning = oversubscribed(shared_limits(STORE, tenants, max_bytes, max_entries), tenants)
    assert (warning is None) == (over is None)
    assert over is None or (warning is not None and over in warning and "learn how much" in warning)


@pytest.mark.parametrize(
    ("key", "tenant"), [(f"{ONE}/resp_1", ONE), ("resp_1", ""), (f"\x00{TWO}/resp_1", f"\x00{TWO}")]
)
def test_a_keys_tenant(key: str, tenant: str) -> None:
    assert tenant_of(key) == tenant
