"""The SQLite backend of `ResponseStorage`: one database file under `--data-dir`, in WAL mode.

Every write commits with `synchronous=FULL` before the storage actor replies, so
anything the server acknowledged survives a crash or `kill -9`. The byte and
entry budgets, the store's and each tenant's, are kept by evicting the writing
tenant's least recently updated responses and conversations (a whole conversation
at a time), never another tenant's (`tenant_budget.py`); a record larger than its
tenant's budget is refused, and so is a write its tenant has no room left for.
Not thread-safe by itself: the storage actor calls it from one thread at a time.

Faults stay with the call that meets them. Every row read is checked
(`decoding.py`), so a damaged record is a `DamagedRecord` for the requests that
read it. A database error while serving a call (`database or disk is full`,
`disk I/O error`) is `StorageUnavailable` (`transaction.py`): the transaction is
rolled back, the in-memory byte and entry counts (in total and by tenant) are
measured again from what is committed, and the connection serves the next call,
so storing resumes by itself once the disk has room. Only opening the database at
start-up may fail for good.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path

import orjson

from courier.storage.decoding import conversation_item, stored_conversation, stored_response
from courier.storage.paging import UnknownCursor
from courier.storage.records import (
    MAX_CHAIN_HOPS,
    Chain,
    ItemPage,
    JsonObject,
    Order,
    PageQuery,
    StorageLimits,
    StorageRefused,
    StoredConversation,
    StoredResponse,
)
from courier.storage.schema import migrate
from courier.storage.tenancy import tenant_of
from courier.storage.tenant_budget import Usage, UsageBook, no_room, over_budget, too_large
from courier.storage.transaction import Transaction, served

logger = logging.getLogger(__name__)

DATABASE_NAME = "courier.sqlite3"
_EVICTION_BATCH = 64


class SqliteStorage:
    # One connection, used by one thread at a time; a local file is never unreachable (a full disk is unavailable).
    max_concurrent_calls = 1

    def __init__(self, data_dir: Path, limits: StorageLimits, clock: Callable[[], float] = time.time) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / DATABASE_NAME
        self._limits = limits
        self._clock = clock
        # The storage actor hands calls to a worker thread, one at a time.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        migrate(self._db, self.path)
        self._usage = self._measure()
        # Set when a failed transaction could not re-measure them; the next transaction measures first.
        self._counts_stale = False

    @property
    def stored_bytes(self) -> int:
        return self._usage.total.bytes

    @property
    def stored_entries(self) -> int:
        return self._usage.total.entries

    def tenant_usage(self, tenant: str) -> Usage:
        """What `tenant` stores (its responses, conversations and their items)."""
        usage = self._usage.of(tenant)
        return Usage(usage.bytes, usage.entries)

    def reach(self) -> None:
        """Nothing to reach: the database is a local file."""

    def close(self) -> None:
        try:
            self._db.close()
        except sqlite3.OperationalError as error:  # everything acknowledged is committed already
            logger.warning("storage: closing the database failed: %s", error)

    # Responses

    @served
    def save_response(self, response: StoredResponse, conversation_items: Sequence[JsonObject]) -> None:
        input_blob = orjson.dumps(list(response.input_items))
        response_blob = orjson.dumps(response.response)
        nbytes = len(input_blob) + len(response_blob)
        item_rows = [_item_row(item) for item in conversation_items] if response.conversation_id else []
        added = nbytes + sum(len(blob) for _, blob in item_rows)
        if refusal := too_large("response", added, self._limits):
            raise StorageRefused(refusal)
        now = self._clock()
        with self._transaction():
            replaced = self._db.execute("SELECT nbytes FROM responses WHERE id = ?", (response.id,)).fetchone()
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    response.id,
                    response.created_at,
                    now,
                    response.previous_response_id,
                    response.conversation_id,
                    input_blob,
                    response_blob,
                    nbytes,
                ),
            )
            # A conversation deleted while the response was generated gets nothing appended.
            if response.conversation_id and item_rows and self._conversation_exists(response.conversation_id):
                self._insert_items(response.conversation_id, item_rows, now)
            self._count(response.id, nbytes - (replaced[0] if replaced else 0), 0 if replaced else 1)
            self._enforce_limits(keep=("responses", response.id))

    @served
    def load_response(self, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT id, created_at, previous_response_id, conversation_id, input_items, response "
            "FROM responses WHERE id = ?",
            (response_id,),
        ).fetchone()
        return stored_response(row) if row else None

    @served
    def load_chain(self, response_id: str) -> Chain | None:
        rows = self._db.execute(
            """
            WITH RECURSIVE chain (id, previous_response_id, depth) AS (
                SELECT id, previous_response_id, 0 FROM responses WHERE id = ?
                UNION ALL
                SELECT r.id, r.previous_response_id, chain.depth + 1
                FROM responses AS r JOIN chain ON r.id = chain.previous_response_id
                WHERE chain.depth < ?
            )
            SELECT r.id, r.created_at, r.previous_response_id, r.conversation_id, r.input_items, r.response
            FROM chain JOIN responses AS r ON r.id = chain.id ORDER BY chain.depth DESC
            """,
            (response_id, MAX_CHAIN_HOPS),
        ).fetchall()
        if not rows:
            return None
        responses = tuple(stored_response(row) for row in rows)
        return Chain(responses=responses, missing=responses[0].previous_response_id)

    @served
    def delete_response(self, response_id: str) -> bool:
        with self._transaction():
            return self._delete_response(response_id)

    # Conversations

    @served
    def create_conversation(self, conversation: StoredConversation, items: Sequence[JsonObject]) -> None:
        metadata = orjson.dumps(dict(conversation.metadata))
        item_rows = [_item_row(item) for item in items]
        added = len(metadata) + sum(len(blob) for _, blob in item_rows)
        if refusal := too_large("conversation", added, self._limits):
            raise StorageRefused(refusal)
        now = self._clock()
        with self._transaction():
            self._db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, ?)",
                (conversation.id, conversation.created_at, now, metadata, len(metadata)),
            )
            self._count(conversation.id, len(metadata), 1)
            self._insert_items(conversation.id, item_rows, now)
            self._enforce_limits(keep=("conversations", conversation.id))

    @served
    def load_conversation(self, conversation_id: str) -> StoredConversation | None:
        row = self._db.execute(
            "SELECT id, created_at, metadata FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return stored_conversation(row) if row else None

    @served
    def update_conversation(self, conversation_id: str, metadata: Mapping[str, str]) -> StoredConversation | None:
        blob = orjson.dumps(dict(metadata))
        with self._transaction():
            row = self._db.execute("SELECT nbytes FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if row is None:
                return None
            self._db.execute(
                "UPDATE conversations SET metadata = ?, nbytes = ?, updated_at = ? WHERE id = ?",
                (blob, len(blob), self._clock(), conversation_id),
            )
            self._count(conversation_id, len(blob) - row[0], 0)
        return self.load_conversation(conversation_id)

    @served
    def delete_conversation(self, conversation_id: str) -> bool:
        with self._transaction():
            return self._delete_conversation(conversation_id)

    @served
    def append_conversation_items(self, conversation_id: str, items: Sequence[JsonObject]) -> bool:
        item_rows = [_item_row(item) for item in items]
        if refusal := too_large("items' JSON", sum(len(blob) for _, blob in item_rows), self._limits):
            raise StorageRefused(refusal)
        with self._transaction():
            if not self._conversation_exists(conversation_id):
                return False
            self._insert_items(conversation_id, item_rows, self._clock())
            self._enforce_limits(keep=("conversations", conversation_id))
        return True

    @served
    def conversation_items(self, conversation_id: str) -> tuple[JsonObject, ...] | None:
        if not self._conversation_exists(conversation_id):
            return None
        # Every row read before any is decoded: a damaged one must not leave the statement (and its snapshot) open.
        rows = self._db.execute(
            "SELECT id, item FROM conversation_items WHERE conversation_id = ? ORDER BY seq", (conversation_id,)
        ).fetchall()
        return tuple(conversation_item(conversation_id, item_id, blob) for item_id, blob in rows)

    @served
    def list_conversation_items(self, conversation_id: str, page: PageQuery) -> ItemPage | None:
        if not self._conversation_exists(conversation_id):
            return None
        ascending = page.order is Order.ASC
        bound = -1 if ascending else 2**62
        if page.after is not None:
            row = self._db.execute(
                "SELECT seq FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, page.after)
            ).fetchone()
            if row is None:
                raise UnknownCursor(page.after)
            bound = row[0]
        comparison, direction = (">", "ASC") if ascending else ("<", "DESC")
        rows = self._db.execute(
            f"SELECT id, item FROM conversation_items WHERE conversation_id = ? AND seq {comparison} ? "
            f"ORDER BY seq {direction} LIMIT ?",
            (conversation_id, bound, page.limit + 1),
        ).fetchall()
        items = tuple(conversation_item(conversation_id, item_id, blob) for item_id, blob in rows[: page.limit])
        return ItemPage(items=items, has_more=len(rows) > page.limit)

    @served
    def load_conversation_item(self, conversation_id: str, item_id: str) -> JsonObject | None:
        row = self._db.execute(
            "SELECT item FROM conversation_items WHERE conversation_id = ? AND id = ?", (conversation_id, item_id)
        ).fetchone()
        return conversation_item(conversation_id, item_id, row[0]) if row else None

    @served
    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool | None:
        with self._transaction():
            if not self._conversation_exists(conversation_id):
                return None
            row = self._db.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND id = ? RETURNING nbytes",
                (conversation_id, item_id),
            ).fetchone()
            if row is None:
                return False
            self._count(conversation_id, -row[0], 0)
            self._touch_conversation(conversation_id, self._clock())
        return True

    # Budgets

    @served
    def sweep(self, now: float) -> int:
        cutoff = now - self._limits.ttl_s
        with self._transaction():
            expired = self._db.execute(
                "SELECT 'responses', id FROM responses WHERE updated_at < ? "
                "UNION ALL SELECT 'conversations', id FROM conversations WHERE updated_at < ?",
                (cutoff, cutoff),
            ).fetchall()
            for table, record_id in expired:
                self._delete(table, record_id)
        if expired:
            logger.info(
                "storage: %d responses/conversations expired (unused for %.0f s)", len(expired), self._limits.ttl_s
            )
        return len(expired)

    def _enforce_limits(self, keep: tuple[str, str]) -> None:
        """After a write of the record `keep` (a table and its key): evict its tenant's least recently updated other
        records while the tenant is past its share or the store past its budget; with none left, refuse the write
        (the transaction rolls back). Another tenant's records are never touched."""
        tenant = tenant_of(keep[1])
        evicted = 0
        while over_budget(self._usage.of(tenant), self._usage.total, self._limits):
            oldest = self._db.execute(
                "SELECT 'responses', id, updated_at FROM responses WHERE tenant = ? "
                "UNION ALL SELECT 'conversations', id, updated_at FROM conversations WHERE tenant = ? "
                "ORDER BY updated_at LIMIT ?",
                (tenant, tenant, _EVICTION_BATCH),
            ).fetchall()
            victims = [(table, record_id) for table, record_id, _ in oldest if (table, record_id) != keep]
            if not victims:
                raise StorageRefused(no_room(self._usage.of(tenant), self._limits))
            for table, record_id in victims:
                if not over_budget(self._usage.of(tenant), self._usage.total, self._limits):
                    break
                self._delete(table, record_id)
                evicted += 1
        if evicted:
            logger.info("storage: evicted %d least recently updated responses/conversations to stay in budget", evicted)

    # Internals

    def _delete(self, table: str, record_id: str) -> None:
        if table == "responses":
            self._delete_response(record_id)
        else:
            self._delete_conversation(record_id)

    def _delete_response(self, response_id: str) -> bool:
        row = self._db.execute("DELETE FROM responses WHERE id = ? RETURNING nbytes", (response_id,)).fetchone()
        if row is None:
            return False
        self._count(response_id, -row[0], -1)
        return True

    def _delete_conversation(self, conversation_id: str) -> bool:
        items = self._db.execute(
            "SELECT COALESCE(SUM(nbytes), 0) FROM conversation_items WHERE conversation_id = ?", (conversation_id,)
        ).fetchone()[0]
        row = self._db.execute("DELETE FROM conversations WHERE id = ? RETURNING nbytes", (conversation_id,)).fetchone()
        if row is None:
            return False
        self._count(conversation_id, -(row[0] + items), -1)
        return True

    def _insert_items(self, conversation_id: str, rows: Sequence[tuple[str, bytes]], now: float) -> None:
        self._db.executemany(
            "INSERT INTO conversation_items (conversation_id, id, item, nbytes) VALUES (?, ?, ?, ?)",
            [(conversation_id, item_id, blob, len(blob)) for item_id, blob in rows],
        )
        self._count(conversation_id, sum(len(blob) for _, blob in rows), 0)
        self._touch_conversation(conversation_id, now)

    def _touch_conversation(self, conversation_id: str, now: float) -> None:
        self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))

    def _conversation_exists(self, conversation_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is not None

    def _count(self, key: str, nbytes: int, entries: int) -> None:
        """`nbytes` and `entries` (negative: freed) for the record stored under `key`, and its tenant."""
        self._usage.add(tenant_of(key), nbytes, entries)

    def _transaction(self) -> Transaction:
        if self._counts_stale:
            self._usage = self._measure()
            self._counts_stale = False
        return Transaction(self._db, self._recount)

    def _recount(self) -> None:
        """A transaction was rolled back: the in-memory counts are measured again from what is committed (or, if
        even that fails, before the next transaction)."""
        self._counts_stale = True
        with suppress(sqlite3.OperationalError):
            self._usage = self._measure()
            self._counts_stale = False

    def _measure(self) -> UsageBook:
        """What is committed, by tenant: each record's own bytes, and a conversation's items with it."""
        book = UsageBook()
        for table in ("responses", "conversations"):
            for tenant, nbytes, entries in self._db.execute(
                f"SELECT tenant, SUM(nbytes), COUNT(*) FROM {table} GROUP BY tenant"  # a name of ours, not input
            ):
                book.add(tenant, int(nbytes), int(entries))
        for tenant, nbytes in self._db.execute(
            "SELECT c.tenant, SUM(i.nbytes) FROM conversation_items AS i "
            "JOIN conversations AS c ON c.id = i.conversation_id GROUP BY c.tenant"
        ):
            book.add(tenant, int(nbytes), 0)
        return book


def _item_row(item: JsonObject) -> tuple[str, bytes]:
    return str(item["id"]), orjson.dumps(item)
