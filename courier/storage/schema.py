"""The SQLite database's tables and their version: created on first use, refused when newer than this Courier.

Version 2 gives responses and conversations a `tenant` column, computed from the id
(`tenancy.tenant_of` in SQL), and an index by tenant and age, so each tenant's budget
evicts its own least recently updated records (`tenant_budget.py`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    previous_response_id TEXT,
    conversation_id TEXT,
    input_items BLOB NOT NULL,
    response BLOB NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (updated_at);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    metadata BLOB NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_by_age ON conversations (updated_at);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    id TEXT NOT NULL,
    item BLOB NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS conversation_items_by_id ON conversation_items (conversation_id, id);
CREATE INDEX IF NOT EXISTS conversation_items_in_order ON conversation_items (conversation_id, seq);
"""


# The tenant a key belongs to, as `tenancy.tenant_of` says: what comes before its first "/", else "".
_TENANT = "CASE WHEN instr(id, '/') > 0 THEN substr(id, 1, instr(id, '/') - 1) ELSE '' END"
_VERSION_2 = (
    f"ALTER TABLE responses ADD COLUMN tenant TEXT GENERATED ALWAYS AS ({_TENANT}) VIRTUAL",
    f"ALTER TABLE conversations ADD COLUMN tenant TEXT GENERATED ALWAYS AS ({_TENANT}) VIRTUAL",
    "CREATE INDEX responses_by_tenant_age ON responses (tenant, updated_at)",
    "CREATE INDEX conversations_by_tenant_age ON conversations (tenant, updated_at)",
)


def migrate(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"{path} has schema version {version}; this Courier knows up to {SCHEMA_VERSION}")
    db.executescript(_SCHEMA)  # version 1's tables, where there are none yet
    if version >= SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        if version < 2:
            for statement in _VERSION_2:
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
