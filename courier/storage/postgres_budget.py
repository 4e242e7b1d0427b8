"""The byte, record-count and TTL budgets of a PostgreSQL store, kept in SQL so every replica shares them.

`storage_usage` is one row: the bytes and records stored. Every write transaction
ends with `settle`, one UPDATE that adds the write's change and returns the totals;
the row then stays locked until the commit, so writers on every replica take turns
there, and one that finds the totals over budget evicts the least recently updated
records before the next writer reads them. A record over the whole budget never gets
this far (the backend refuses it first).

Victims are chosen `FOR UPDATE SKIP LOCKED`: a record that another transaction is
writing is passed over, never waited for. A writer takes its own records' locks
first and the usage row last, so the usage row is the only lock two writers can wait
on each other for, and they cannot deadlock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg

from courier.storage.records import StorageLimits

logger = logging.getLogger(__name__)

EVICTION_BATCH = 64
RESPONSES = "responses"
CONVERSATIONS = "conversations"


@dataclass(slots=True)
class UsageChange:
    """What one transaction adds to (or, negative, takes from) the stored bytes and records."""

    bytes: int = 0
    entries: int = 0

    def add(self, nbytes: int, entries: int) -> None:
        self.bytes += nbytes
        self.entries += entries


def usage(connection: psycopg.Connection[Any]) -> tuple[int, int]:
    """The bytes and records stored, as committed."""
    row = connection.execute("SELECT bytes, entries FROM storage_usage").fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def settle(
    connection: psycopg.Connection[Any], change: UsageChange, limits: StorageLimits, keep: tuple[str, str] | None = None
) -> int:
    """Add `change` to the shared usage (locking it until commit) and evict until within budget, sparing `keep`
    (a table and id: the record just written). Returns how many records were evicted."""
    row = connection.execute(
        "UPDATE storage_usage SET bytes = bytes + %s, entries = entries + %s RETURNING bytes, entries",
        (change.bytes, change.entries),
    ).fetchone()
    stored_bytes, entries = (int(row[0]), int(row[1])) if row else (0, 0)
    freed = UsageChange()
    while stored_bytes > limits.max_bytes or entries > limits.max_entries:
        victims = _oldest(connection, keep)
        if not victims:  # all that is left is being written by someone: the next writer evicts
            break
        for table, record_id in victims:
            if stored_bytes <= limits.max_bytes and entries <= limits.max_entries:
                break
            nbytes = _delete_victim(connection, table, record_id)
            if nbytes is not None:
                stored_bytes -= nbytes
                entries -= 1
                freed.add(-nbytes, -1)
    if freed.entries:
        connection.execute(
            "UPDATE storage_usage SET bytes = bytes + %s, entries = entries + %s", (freed.bytes, freed.entries)
        )
        logger.info(
            "storage: evicted %d least recently updated responses/conversations to stay in budget", -freed.entries
        )
    return -freed.entries


def sweep(connection: psycopg.Connection[Any], cutoff: float) -> UsageChange:
    """Delete every response and conversation last updated before `cutoff` (one that another transaction is
    writing is being renewed: it is passed over). Returns what was freed; the caller settles it."""
    freed = UsageChange()
    for (nbytes,) in connection.execute(
        "DELETE FROM responses WHERE id IN "
        "(SELECT id FROM responses WHERE updated_at < %s FOR UPDATE SKIP LOCKED) RETURNING nbytes",
        (cutoff,),
    ).fetchall():
        freed.add(-int(nbytes), -1)
    expired = connection.execute(
        "SELECT id FROM conversations WHERE updated_at < %s FOR UPDATE SKIP LOCKED", (cutoff,)
    ).fetchall()
    if expired:
        count, nbytes = delete_conversations(connection, [record_id for (record_id,) in expired])
        freed.add(-nbytes, -count)
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


def _oldest(connection: psycopg.Connection[Any], keep: tuple[str, str] | None) -> list[tuple[str, str]]:
    """Up to `EVICTION_BATCH` least recently updated records of both tables, oldest first, locked."""
    spared_response = keep[1] if keep and keep[0] == RESPONSES else None
    spared_conversation = keep[1] if keep and keep[0] == CONVERSATIONS else None
    responses = connection.execute(
        "SELECT id, updated_at FROM responses WHERE id IS DISTINCT FROM %s "
        "ORDER BY updated_at LIMIT %s FOR UPDATE SKIP LOCKED",
        (spared_response, EVICTION_BATCH),
    ).fetchall()
    conversations = connection.execute(
        "SELECT id, updated_at FROM conversations WHERE id IS DISTINCT FROM %s "
        "ORDER BY updated_at LIMIT %s FOR UPDATE SKIP LOCKED",
        (spared_conversation, EVICTION_BATCH),
    ).fetchall()
    both = [(updated_at, RESPONSES, record_id) for record_id, updated_at in responses]
    both += [(updated_at, CONVERSATIONS, record_id) for record_id, updated_at in conversations]
    both.sort()
    return [(table, record_id) for _, table, record_id in both[:EVICTION_BATCH]]
