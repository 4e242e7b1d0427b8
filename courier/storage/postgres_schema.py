"""The PostgreSQL database's tables and their versions: migrations applied when a Courier first reaches it.

Several replicas may start at once against one database. Each takes the same
transaction-scoped advisory lock before it reads which migrations are applied, so
one of them applies what is missing and the others then find it done. A database
whose schema is newer than this Courier knows is refused, as SQLite's is. A Courier
migrates once, on its first connection: at start-up, or, for a database it could not
reach then, when the first call that needs storage reaches it.

Records are `json`: JSON text that PostgreSQL checks and keeps as written, never
taken apart in SQL (every read returns it whole, `decoding.py` checks it). Version 1
made them JSONB, which holds no NUL character (`"\\u0000"` is refused) and reorders an
object's keys; version 2 makes them `json`, which holds any JSON string, as SQLite's
text does. `storage_usage` is one row holding the bytes and records stored, and
`tenant_usage` (version 3) one row per tenant, which every write updates in its own
transaction, so every replica enforces the same budgets (`postgres_budget.py`). A
conversation's `next_position` is the position its next item gets, assigned under the
conversation's row lock (`postgres.py`).
"""

from __future__ import annotations

from typing import Any, LiteralString

import psycopg

# Any fixed 64-bit key: the lock only has to be the same for every Courier sharing the database.
SCHEMA_LOCK_KEY = 0x636F_7572_6965_7201

_VERSION_1: tuple[LiteralString, ...] = (
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        previous_response_id TEXT,
        conversation_id TEXT,
        input_items JSONB NOT NULL,
        response JSONB NOT NULL,
        nbytes BIGINT NOT NULL
    )
    """,
    "CREATE INDEX responses_by_age ON responses (updated_at)",
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        created_at BIGINT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        metadata JSONB NOT NULL,
        nbytes BIGINT NOT NULL,
        next_position BIGINT NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX conversations_by_age ON conversations (updated_at)",
    """
    CREATE TABLE conversation_items (
        conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        position BIGINT NOT NULL,
        id TEXT NOT NULL,
        item JSONB NOT NULL,
        nbytes BIGINT NOT NULL,
        PRIMARY KEY (conversation_id, position),
        UNIQUE (conversation_id, id)
    )
    """,
    """
    CREATE TABLE storage_usage (
        singleton BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
        bytes BIGINT NOT NULL,
        entries BIGINT NOT NULL
    )
    """,
    "INSERT INTO storage_usage (bytes, entries) VALUES (0, 0)",
)

# Records as `json`, which stores a NUL character (\u0000) as written, where JSONB refuses it. The tables are
# rewritten once, under the lock. A replica of version 1 still writing JSONB during a rolling upgrade is served
# too: PostgreSQL casts jsonb to json on assignment.
_VERSION_2: tuple[LiteralString, ...] = (
    "ALTER TABLE responses ALTER COLUMN input_items TYPE json USING input_items::json, "
    "ALTER COLUMN response TYPE json USING response::json",
    "ALTER TABLE conversations ALTER COLUMN metadata TYPE json USING metadata::json",
    "ALTER TABLE conversation_items ALTER COLUMN item TYPE json USING item::json",
)

# Each tenant's budget (`tenant_budget.py`): a record's tenant, computed from its id as `tenancy.tenant_of` does (so
# a replica of version 2 still writing during a rolling upgrade stores it right), an index to find a tenant's least
# recently updated records, and `tenant_usage`, a row per tenant like `storage_usage`, filled from what is stored.
_VERSION_3: tuple[LiteralString, ...] = (
    "ALTER TABLE responses ADD COLUMN tenant TEXT NOT NULL "
    "GENERATED ALWAYS AS (CASE WHEN strpos(id, '/') > 0 THEN split_part(id, '/', 1) ELSE '' END) STORED",
    "ALTER TABLE conversations ADD COLUMN tenant TEXT NOT NULL "
    "GENERATED ALWAYS AS (CASE WHEN strpos(id, '/') > 0 THEN split_part(id, '/', 1) ELSE '' END) STORED",
    "CREATE INDEX responses_by_tenant_age ON responses (tenant, updated_at)",
    "CREATE INDEX conversations_by_tenant_age ON conversations (tenant, updated_at)",
    "CREATE TABLE tenant_usage (tenant TEXT PRIMARY KEY, bytes BIGINT NOT NULL, entries BIGINT NOT NULL)",
    """
    INSERT INTO tenant_usage (tenant, bytes, entries)
    SELECT tenant, SUM(nbytes), SUM(entries) FROM (
        SELECT tenant, nbytes, 1 AS entries FROM responses
        UNION ALL SELECT tenant, nbytes, 1 FROM conversations
        UNION ALL SELECT c.tenant, i.nbytes, 0 FROM conversation_items AS i
            JOIN conversations AS c ON c.id = i.conversation_id
    ) AS stored GROUP BY tenant
    """,
)

# Migration N (1-based) brings the schema from version N-1 to N; an applied one is never edited, only followed.
MIGRATIONS: tuple[tuple[LiteralString, ...], ...] = (_VERSION_1, _VERSION_2, _VERSION_3)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(connection: psycopg.Connection[Any]) -> int:
    """Apply the migrations the database lacks; returns how many. Refuses a schema newer than `SCHEMA_VERSION`."""
    with connection.transaction():
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
        connection.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        row = connection.execute("SELECT COALESCE(MAX(version), 0) FROM schema_migrations").fetchone()
        current = int(row[0]) if row else 0
        if current > SCHEMA_VERSION:
            raise RuntimeError(f"the database has schema version {current}; this Courier knows up to {SCHEMA_VERSION}")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[version - 1]:
                connection.execute(statement)
            connection.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
    return SCHEMA_VERSION - current
