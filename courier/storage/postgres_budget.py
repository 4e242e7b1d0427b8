"""The byte, record-count and TTL budgets of a PostgreSQL store, kept in SQL so every replica shares them.

`storage_usage` is one row: the bytes and records stored; `tenant_usage` a row per
tenant (an API key) with the same of its own records. Every write transaction ends
with `settle`, which adds the write's change to its tenant's row and then to the
store's, returning both; the rows then stay locked until the commit, so writers on
every replica take turns there. A writer that finds its tenant past its share, or the
store past its budget, evicts its own tenant's least recently updated records before
the next writer reads them, and never another tenant's; with none of its own left to
evict it is refused (`StorageRefused`) and its transaction rolls back
(`tenant_budget.py` decides). A record over its tenant's whole budget never gets this
far (the backend refuses it first).

Victims are chosen `FOR UPDATE SKIP LOCKED`: a record that another transaction is
writing is passed over, never waited for. A writer takes its own records' locks
first, then tenant rows (several in sorted order: only the TTL sweep takes more than
one) and the store's row last, so two writers cannot deadlock.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from courier.storage.records import StorageLimits, StorageRefused
from courier.storage.tenant_budget import Usage, no_room, over_budget

logger = logging.getLogger(__name__)

EVICTION_BATCH = 64
RESPONSES = "responses"
CONVERSATIONS = "conversations"


def usage(connection: psycopg.Connection[Any]) -> tuple[int, int]:
    """The bytes and records stored, as committed."""
    row = connection.execute("SELECT bytes, entries FROM storage_usage").fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def tenant_usage(connection: psycopg.Connection[Any], tenant: str) -> Usage:
    """The bytes and records `tenant` stores, as committed."""
    row = connection.execute("SELECT bytes, entries FROM tenant_usage WHERE tenant = %s", (tenant,)).fetchone()
    return Usage(int(row[0]), int(row[1])) if row else Usage()


def settle(
    connection: psycopg.Connection[Any],
    tenant: str,
    change: Usage,
    limits: StorageLimits,
    keep: tuple[str, str] | None = None,
) -> int:
    """Add `change` to `tenant`'s usage and the store's (locking both until commit). After a write (`keep`: the
    table and id it wrote), evict the tenant's own least recently updated other records until it is within its
    share and the store within its budget; `StorageRefused` when it has none left. Returns how many were evicted."""
    mine, total = count(connection, {tenant: change})
    if keep is None:
        return 0
    freed = Usage()
    while over_budget(mine, total, limits):
        victims = _oldest(connection, tenant, keep)
        if not victims:  # the rest is other tenants' (or being written by someone): never theirs
            raise StorageRefused(no_room(mine, limits))
        for table, record_id in victims:
            if not over_budget(mine, total, limits):
                break
            nbytes = _delete_victim(connection, table, record_id)
            if nbytes is not None:
                for usage in (mine, total):
                    usage.add(-nbytes, -1)
                freed.add(-nbytes, -1)
    if freed.entries:
        count(connection, {tenant: freed})
        logger.info(
            "storage: evicted %d least recently updated responses/conversations to stay in budget", -freed.entries
        )
    return -freed.entries


def count(connection: psycopg.Connection[Any], changes: dict[str, Usage]) -> tuple[Usage, Usage]:
    """Add each tenant's change to its row (in sorted order) and their sum to the store's row, which locks them all
    until commit. Returns the last tenant's usage (the only one, for a write) and the store's."""
    tenant = Usage()
    summed = Usage()
    for name in sorted(changes):
        change = changes[name]
        row = connection.execute(
            "INSERT INTO tenant_usage (tenant, bytes, entries) VALUES (%s, %s, %s) ON CONFLICT (tenant) DO UPDATE "
            "SET bytes = tenant_usage.bytes + EXCLUDED.bytes, entries = tenant_usage.entries + EXCLUDED.entries "
            "RETURNING bytes, entries",
            (name, change.bytes, change.entries),
        ).fetchone()
        tenant = Usage(int(row[0]), int(row[1])) if row else Usage()
        summed.add(change.bytes, change.entries)
    row = connection.execute(
        "UPDATE storage_usage SET bytes = bytes + %s, entries = entries + %s RETURNING bytes, entries",
        (summed.bytes, summed.entries),
    ).fetchone()
    return tenant, Usage(int(row[0]), int(row[1])) if row else Usage()


def sweep(connection: psycopg.Connection[Any], cutoff: float) -> dict[str, Usage]:
    """Delete every response and conversation last updated before `cutoff` (one that another transaction is
    writing is being renewed: it is passed over). Returns what was freed, by tenant; the caller counts it."""
    freed: dict[str, Usage] = {}
    for tenant, nbytes in connection.execute(
        "DELETE FROM responses WHERE id IN "
        "(SELECT id FROM responses WHERE updated_at < %s FOR UPDATE SKIP LOCKED) RETURNING tenant, nbytes",
        (cutoff,),
    ).fetchall():
        freed.setdefault(tenant, Usage()).add(-int(nbytes), -1)
    expired: dict[str, list[str]] = {}
    for record_id, tenant in connection.execute(
        "SELECT id, tenant FROM conversations WHERE updated_at < %s FOR UPDATE SKIP LOCKED", (cutoff,)
    ).fetchall():
        expired.setdefault(tenant, []).append(record_id)
    for tenant, ids in expired.items():
        deleted, nbytes = delete_conversations(connection, ids)
        freed.setdefault(tenant, Usage()).add(-nbytes, -deleted)
    return freed


def delete_response(connection: psycopg.Connection[Any], response_id: str) -> int | None:
    """The bytes the deleted response held; None if it was not stored."""
    row = connection.execute("DELETE FROM responses WHERE id = %s RETURNING nbytes", (response_id,)).fetchone()
    return int(row[0]) if row else None


def delete_conversations(connection: psycopg.Connection[Any], conversation_ids: list[str]) -> tuple[int, int]:
    """Delete conversations with their items: how many were stored, and the bytes they held.

    Each is locked before its items are summed, and items are only ever added or removed under that lock, so the
    sum (a statement of its own, hence a snapshot taken after the lock) counts every item the delete removes."""
    locked = connection.execute(
        "SELECT id FROM conversations WHERE id = ANY(%s) FOR UPDATE", (conversation_ids,)
    ).fetchall()
    if not locked:
        return 0, 0
    ids = [record_id for (record_id,) in locked]
    row = connection.execute(
        "SELECT COALESCE(SUM(nbytes), 0) FROM conversation_items WHERE conversation_id = ANY(%s)", (ids,)
    ).fetchone()
    items = int(row[0]) if row else 0
    gone = connection.execute("DELETE FROM conversations WHERE id = ANY(%s) RETURNING nbytes", (ids,)).fetchall()
    return len(gone), items + sum(int(nbytes) for (nbytes,) in gone)


def _delete_victim(connection: psycopg.Connection[Any], table: str, record_id: str) -> int | None:
    if table == RESPONSES:
        return delete_response(connection, record_id)
    count, nbytes = delete_conversations(connection, [record_id])
    return nbytes if count else None


def _oldest(connection: psycopg.Connection[Any], tenant: str, keep: tuple[str, str]) -> list[tuple[str, str]]:
    """Up to `EVICTION_BATCH` of `tenant`'s least recently updated records of both tables but `keep`, oldest first,
    locked."""
    spared_response = keep[1] if keep[0] == RESPONSES else None
    spared_conversation = keep[1] if keep[0] == CONVERSATIONS else None
    responses = connection.execute(
        "SELECT id, updated_at FROM responses WHERE tenant = %s AND id IS DISTINCT FROM %s "
        "ORDER BY updated_at LIMIT %s FOR UPDATE SKIP LOCKED",
        (tenant, spared_response, EVICTION_BATCH),
    ).fetchall()
    conversations = connection.execute(
        "SELECT id, updated_at FROM conversations WHERE tenant = %s AND id IS DISTINCT FROM %s "
        "ORDER BY updated_at LIMIT %s FOR UPDATE SKIP LOCKED",
        (tenant, spared_conversation, EVICTION_BATCH),
    ).fetchall()
    both = [(updated_at, RESPONSES, record_id) for record_id, updated_at in responses]
    both += [(updated_at, CONVERSATIONS, record_id) for record_id, updated_at in conversations]
    both.sort()
    return [(table, record_id) for _, table, record_id in both[:EVICTION_BATCH]]
