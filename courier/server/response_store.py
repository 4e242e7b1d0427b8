"""Opening the response store: PostgreSQL when `--storage` names a database, else SQLite under `--data-dir`.

The store opens before the model loads (stored records need no model). Opening is
the one storage failure that stops the server: a database it cannot reach, log in
to, or migrate. Once open, a database that fails is a 503 for the requests that need
it (`actors/storage.py`). The database is named in logs without its password.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

import psycopg

from courier.settings import Settings
from courier.storage.postgres import PostgresStorage
from courier.storage.postgres_connection import redacted
from courier.storage.records import ResponseStorage, StorageLimits, StorageUnavailable
from courier.storage.sqlite import SqliteStorage


class StoreNotOpened(Exception):
    """The response store could not be opened; the message says which and why (without a password)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedStore:
    storage: ResponseStorage
    location: str  # the SQLite file, or the database's URL without its password
    entries: int
    nbytes: int


def open_response_store(settings: Settings, limits: StorageLimits) -> OpenedStore:
    """Blocking (runs on a worker thread): connects, and creates or migrates the schema."""
    if settings.storage is not None:
        location = redacted(settings.storage)
        try:
            postgres = PostgresStorage(settings.storage, limits)
            return OpenedStore(
                storage=postgres, location=location, entries=postgres.stored_entries, nbytes=postgres.stored_bytes
            )
        except (psycopg.Error, StorageUnavailable, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise StoreNotOpened(f"cannot open the response store {location}: {reason}") from error
    try:
        sqlite = SqliteStorage(settings.data_dir, limits)
    except (OSError, sqlite3.Error, RuntimeError) as error:
        raise StoreNotOpened(f"cannot open the response store under {settings.data_dir}: {error}") from error
    return OpenedStore(
        storage=sqlite, location=str(sqlite.path), entries=sqlite.stored_entries, nbytes=sqlite.stored_bytes
    )
