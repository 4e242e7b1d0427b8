"""The SQLite database's tables and their version: created on first use, refused when newer than this Courier."""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1

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


def migrate(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise RuntimeError(f"{path} has schema version {version}; this Courier knows up to {SCHEMA_VERSION}")
    db.executescript(_SCHEMA)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
