"""The PostgreSQL backend of `ResponseStorage`: one database that several Courier replicas share.

Same records and semantics as the SQLite backend; what changes is that other
processes write the same tables at the same time:

- Conversation items get their positions inside the transaction that appends them,
  under the conversation's row lock (`SELECT ... FOR UPDATE`), so two replicas
  appending to one conversation take turns: neither's items interleave with the
  other's, and none is lost (`postgres_items.py`).
- The byte, record-count and TTL budgets, the store's and each tenant's, live in SQL
  (`postgres_budget.py`), so they hold for all replicas together, not for one
  process's counters; a write evicts only its own tenant's records.
- A previous_response_id chain is one recursive query, however long.

Every write commits before the storage actor replies. Calls run side by side, up to
the pool's size, each in its own connection and transaction. A database that is slow
is `StorageUnavailable` for the calls that need it, and one that cannot be reached
`StorageUnreachable`, found without waiting out the pool (`postgres_connection.py`);
`reach` connects again once it is back. One that cannot be reached
when the backend is made is not a failure either: `unreachable` says why, and the
first call that reaches it applies the schema migrations (`postgres_schema.py`) and
opens the pool. Only a misconfiguration fails for good: a malformed URL, a refused
login (`LoginRefused`), a schema newer than this Courier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from psycopg import Connection

from courier.storage.decoding import conversation_item, stored_conversation, stored_response
from courier.storage.paging import UnknownCursor
from courier.storage.postgres_budget import (
    CONVERSATIONS,
    RESPONSES,
    count,
    delete_conversations,
    delete_response,
    settle,
    sweep,
    tenant_usage,
    usage,
)
from courier.storage.postgres_connection import POOL_MAX_SIZE, Database, redacted, served
from courier.storage.postgres_items import append_items, item_row, json_text
from courier.storage.postgres_schema import migrate
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
from courier.storage.tenancy import tenant_of
from courier.storage.tenant_budget import Usage, too_large

logger = logging.getLogger(__name__)


class PostgresStorage:
    # Each call takes a pool connection of its own, so as many run at once as the pool holds.
    max_concurrent_calls = POOL_MAX_SIZE

    def __init__(self, url: str, limits: StorageLimits, clock: Callable[[], float] = time.time) -> None:
        self.location = redacted(url)
        self._limits = limits
        self._clock = clock
        self._database = Database(url, self._migrate)
        # Why the database could not be reached just now (None: it was, and is migrated); calls keep trying.
        self.unreachable = self._database.try_open()

    @property
    def stored_bytes(self) -> int:
        return self._usage()[0]

    @property
    def stored_entries(self) -> int:
        return self._usage()[1]

    @served
    def tenant_usage(self, tenant: str) -> Usage:
        """What `tenant` stores (its responses, conversations and their items), as committed."""
        with self._database.connection() as connection:
            return tenant_usage(connection, tenant)

    @served
    def reach(self) -> None:
        self._database.reach()

    def close(self) -> None:
        self._database.close()

    # Responses

    @served
    def save_response(self, response: StoredResponse, conversation_items: Sequence[JsonObject]) -> None:
        input_blob, input_bytes = json_text(list(response.input_items))
        response_blob, response_bytes = json_text(response.response)
        nbytes = input_bytes + response_bytes
        item_rows = [item_row(item) for item in conversation_items] if response.conversation_id else []
        added = nbytes + sum(size for _, _, size in item_rows)
        if refusal := too_large("response", added, self._limits):
            raise StorageRefused(refusal)
        now = self._clock()
        with self._transaction() as connection:
            change = Usage()
            # A conversation deleted while the response was generated gets nothing appended.
            if response.conversation_id and item_rows:
                change.add(append_items(connection, response.conversation_id, item_rows, now) or 0, 0)
            replaced = connection.execute(
                "SELECT nbytes FROM responses WHERE id = %s FOR UPDATE", (response.id,)
            ).fetchone()
            connection.execute(
                "INSERT INTO responses VALUES (%s, %s, %s, %s, %s, %s::json, %s::json, %s) "
                "ON CONFLICT (id) DO UPDATE SET created_at = EXCLUDED.created_at, updated_at = EXCLUDED.updated_at, "
                "previous_response_id = EXCLUDED.previous_response_id, conversation_id = EXCLUDED.conversation_id, "
                "input_items = EXCLUDED.input_items, response = EXCLUDED.response, nbytes = EXCLUDED.nbytes",
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
            change.add(nbytes - (int(replaced[0]) if replaced else 0), 0 if replaced else 1)
            settle(connection, tenant_of(response.id), change, self._limits, keep=(RESPONSES, response.id))

    @served
    def load_response(self, response_id: str) -> StoredResponse | None:
        if not _storable(response_id):
            return None
        with self._database.connection() as connection:
            row = connection.execute(
                "SELECT id, created_at, previous_response_id, conversation_id, input_items::text, response::text "
                "FROM responses WHERE id = %s",
                (response_id,),
            ).fetchone()
        return stored_response(row) if row else None

    @served
    def load_chain(self, response_id: str) -> Chain | None:
        if not _storable(response_id):
            return None
        with self._database.connection() as connection:
            rows = connection.execute(
                """
                WITH RECURSIVE chain (id, previous_response_id, depth) AS (
                    SELECT id, previous_response_id, 0 FROM responses WHERE id = %s
                    UNION ALL
                    SELECT r.id, r.previous_response_id, chain.depth + 1
                    FROM responses AS r JOIN chain ON r.id = chain.previous_response_id
                    WHERE chain.depth < %s
                )
                SELECT r.id, r.created_at, r.previous_response_id, r.conversation_id, r.input_items::text,
                    r.response::text
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
        if not _storable(response_id):
            return False
        with self._transaction() as connection:
            nbytes = delete_response(connection, response_id)
            if nbytes is None:
                return False
            settle(connection, tenant_of(response_id), Usage(-nbytes, -1), self._limits)
        return True

    # Conversations

    @served
    def create_conversation(self, conversation: StoredConversation, items: Sequence[JsonObject]) -> None:
        metadata, metadata_bytes = json_text(dict(conversation.metadata))
        item_rows = [item_row(item) for item in items]
        added = metadata_bytes + sum(size for _, _, size in item_rows)
        if refusal := too_large("conversation", added, self._limits):
            raise StorageRefused(refusal)
        now = self._clock()
        with self._transaction() as connection:
            connection.execute(
                "INSERT INTO conversations (id, created_at, updated_at, metadata, nbytes) "
                "VALUES (%s, %s, %s, %s::json, %s)",
                (conversation.id, conversation.created_at, now, metadata, metadata_bytes),
            )
            appended = append_items(connection, conversation.id, item_rows, now)
            change = Usage(metadata_bytes + (appended or 0), 1)
            keep = (CONVERSATIONS, conversation.id)
            settle(connection, tenant_of(conversation.id), change, self._limits, keep=keep)

    @served
    def load_conversation(self, conversation_id: str) -> StoredConversation | None:
        if not _storable(conversation_id):
            return None
        with self._database.connection() as connection:
            return self._load_conversation(connection, conversation_id)

    @served
    def update_conversation(self, conversation_id: str, metadata: Mapping[str, str]) -> StoredConversation | None:
        if not _storable(conversation_id):
            return None
        blob, nbytes = json_text(dict(metadata))
        with self._transaction() as connection:
            row = connection.execute(
                "SELECT nbytes FROM conversations WHERE id = %s FOR UPDATE", (conversation_id,)
            ).fetchone()
            if row is None:
                return None
            connection.execute(
                "UPDATE conversations SET metadata = %s::json, nbytes = %s, updated_at = %s WHERE id = %s",
                (blob, nbytes, self._clock(), conversation_id),
            )
            settle(connection, tenant_of(conversation_id), Usage(nbytes - int(row[0]), 0), self._limits)
            return self._load_conversation(connection, conversation_id)

    @served
    def delete_conversation(self, conversation_id: str) -> bool:
        if not _storable(conversation_id):
            return False
        with self._transaction() as connection:
            count, nbytes = delete_conversations(connection, [conversation_id])
            if not count:
                return False
            settle(connection, tenant_of(conversation_id), Usage(-nbytes, -count), self._limits)
        return True

    @served
    def append_conversation_items(self, conversation_id: str, items: Sequence[JsonObject]) -> bool:
        if not _storable(conversation_id):
            return False
        item_rows = [item_row(item) for item in items]
        if refusal := too_large("items' JSON", sum(size for _, _, size in item_rows), self._limits):
            raise StorageRefused(refusal)
        with self._transaction() as connection:
            appended = append_items(connection, conversation_id, item_rows, self._clock())
            if appended is None:
                return False
            keep = (CONVERSATIONS, conversation_id)
            settle(connection, tenant_of(conversation_id), Usage(appended, 0), self._limits, keep=keep)
        return True

    @served
    def conversation_items(self, conversation_id: str) -> tuple[JsonObject, ...] | None:
        if not _storable(conversation_id):
            return None
        with self._database.connection() as connection:
            # One statement, so the conversation and its items are read from one snapshot.
            rows = connection.execute(
                "SELECT i.id, i.item::text FROM conversations AS c "
                "LEFT JOIN conversation_items AS i ON i.conversation_id = c.id "
                "WHERE c.id = %s ORDER BY i.position",
                (conversation_id,),
            ).fetchall()
        if not rows:
            return None
        return tuple(conversation_item(conversation_id, item_id, blob) for item_id, blob in rows if item_id is not None)

    @served
    def list_conversation_items(self, conversation_id: str, page: PageQuery) -> ItemPage | None:
        if not _storable(conversation_id):
            return None
        ascending = page.order is Order.ASC
        with self._database.connection() as connection:
            if not self._conversation_exists(connection, conversation_id):
                return None
            bound = -1 if ascending else 2**62
            if page.after is not None:
                if not _storable(page.after):
                    raise UnknownCursor(page.after)
                row = connection.execute(
                    "SELECT position FROM conversation_items WHERE conversation_id = %s AND id = %s",
                    (conversation_id, page.after),
                ).fetchone()
                if row is None:
                    raise UnknownCursor(page.after)
                bound = int(row[0])
            query = (
                "SELECT id, item::text FROM conversation_items WHERE conversation_id = %s AND position > %s "
                "ORDER BY position ASC LIMIT %s"
                if ascending
                else "SELECT id, item::text FROM conversation_items WHERE conversation_id = %s AND position < %s "
                "ORDER BY position DESC LIMIT %s"
            )
            rows = connection.execute(query, (conversation_id, bound, page.limit + 1)).fetchall()
        items = tuple(conversation_item(conversation_id, item_id, blob) for item_id, blob in rows[: page.limit])
        return ItemPage(items=items, has_more=len(rows) > page.limit)

    @served
    def load_conversation_item(self, conversation_id: str, item_id: str) -> JsonObject | None:
        if not _storable(conversation_id, item_id):
            return None
        with self._database.connection() as connection:
            row = connection.execute(
                "SELECT item::text FROM conversation_items WHERE conversation_id = %s AND id = %s",
                (conversation_id, item_id),
            ).fetchone()
        return conversation_item(conversation_id, item_id, row[0]) if row else None

    @served
    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool | None:
        if not _storable(conversation_id):
            return None
        if not _storable(item_id):
            return None if self.load_conversation(conversation_id) is None else False
        with self._transaction() as connection:
            if not self._lock_conversation(connection, conversation_id):
                return None
            row = connection.execute(
                "DELETE FROM conversation_items WHERE conversation_id = %s AND id = %s RETURNING nbytes",
                (conversation_id, item_id),
            ).fetchone()
            if row is None:
                return False
            connection.execute(
                "UPDATE conversations SET updated_at = %s WHERE id = %s", (self._clock(), conversation_id)
            )
            settle(connection, tenant_of(conversation_id), Usage(-int(row[0]), 0), self._limits)
        return True

    # Budgets

    @served
    def sweep(self, now: float) -> int:
        with self._transaction() as connection:
            freed = sweep(connection, now - self._limits.ttl_s)
            if freed:
                count(connection, freed)
        expired = -sum(change.entries for change in freed.values())
        if expired:
            logger.info("storage: %d responses/conversations expired (unused for %.0f s)", expired, self._limits.ttl_s)
        return expired

    # Internals

    def _migrate(self, connection: Connection[Any]) -> None:
        if applied := migrate(connection):
            logger.info("storage: applied %d schema migrations to %s", applied, self.location)

    def _lock_conversation(self, connection: Connection[Any], conversation_id: str) -> bool:
        row = connection.execute("SELECT 1 FROM conversations WHERE id = %s FOR UPDATE", (conversation_id,))
        return row.fetchone() is not None

    def _conversation_exists(self, connection: Connection[Any], conversation_id: str) -> bool:
        row = connection.execute("SELECT 1 FROM conversations WHERE id = %s", (conversation_id,))
        return row.fetchone() is not None

    def _load_conversation(self, connection: Connection[Any], conversation_id: str) -> StoredConversation | None:
        row = connection.execute(
            "SELECT id, created_at, metadata::text FROM conversations WHERE id = %s", (conversation_id,)
        ).fetchone()
        return stored_conversation(row) if row else None

    @served
    def _usage(self) -> tuple[int, int]:
        with self._database.connection() as connection:
            return usage(connection)

    @contextmanager
    def _transaction(self) -> Iterator[Connection[Any]]:
        """A connection in a transaction: committed when the block ends, rolled back if it raises."""
        with self._database.connection() as connection, connection.transaction():
            yield connection


def _storable(*keys: str) -> bool:
    """Whether a record could be stored under these ids: PostgreSQL text holds no NUL, so an id with one (such as
    the key `tenancy.scoped` makes for an id naming another tenant's record) is never stored, and never sent."""
    return all("\x00" not in key for key in keys)
