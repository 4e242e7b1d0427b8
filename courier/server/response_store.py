"""Opening the response store: PostgreSQL when `--storage` names a database, else SQLite under `--data-dir`.

The store opens before the model loads (stored records need no model). A store that
is misconfigured is the one storage failure that stops the server: a SQLite file it
cannot open, a malformed PostgreSQL URL, a login the database refuses, a schema it
cannot migrate. A PostgreSQL database that does not answer yet is not one: the server
starts without it (`OpenedStore.unreachable` says why), and the requests that need
storage get 503s until a call reaches it, as for a database that fails later
(`actors/storage.py`). The database is named in logs without its password.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

import psycopg

from courier.settings import Settings
from courier.storage.postgres import PostgresStorage
from courier.storage.postgres_connection import LoginRefused, redacted
from courier.storage.records import ResponseStorage, StorageLimits, StorageUnavailable
from courier.storage.sqlite import SqliteStorage


class StoreNotOpened(Exception):
    """The response store could not be opened; the message says which and why (without a password)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedStore:
    storage: ResponseStorage
    location: str  # the SQLite file, or the database's URL without its password
    entries: int  # 0 while unreachable
    nbytes: int
    unreachable: str | None = None  # why the database cannot be reached yet (each call that needs it retries)


def open_response_store(settings: Settings, limits: StorageLimits) -> OpenedStore:
    """Blocking (runs on a worker thread): connects and creates or migrates the schema, if the database answers."""
    if settings.storage is not None:
        location = redacted(settings.storage)
        try:
            postgres = PostgresStorage(settings.storage, limits)
        except (psycopg.Error, LoginRefused, RuntimeError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise StoreNotOpened(f"cannot open the response store {location}: {reason}") from error
        unreachable = postgres.unreachable
        if unreachable is None:
            try:
                return OpenedStore(
                    storage=postgres, location=location, entries=postgres.stored_entries, nbytes=postgres.stored_bytes
                )
            except StorageUnavailable as error:  # reached, then lost or too slow: an outage like any other
                unreachable = str(error)
        return OpenedStore(storage=postgres, location=location, entries=0, nbytes=0, unreachable=unreachable)
    try:
        sqlite = SqliteStorage(settings.data_dir, limits)
    except (OSError, sqlite3.Error, RuntimeError) as error:
        raise StoreNotOpened(f"cannot open the response store under {settings.data_dir}: {error}") from error
    return OpenedStore(
        storage=sqlite, location=str(sqlite.path), entries=sqlite.stored_entries, nbytes=sqlite.stored_bytes
    )
