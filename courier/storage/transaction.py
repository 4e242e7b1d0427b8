"""How one call meets the SQLite database: in a transaction that a failure rolls back, and typed when it fails.

A full disk or an I/O error fails the write that meets it, and SQLite may roll the
transaction back by itself (a ROLLBACK then fails, harmlessly); either way nothing
of it was acknowledged. `Transaction` leaves the connection out of any transaction
after an error, so the next call is served as if the failed one had never been
made, and tells its owner to count its bytes again. `served` turns the database's
"cannot serve this now" errors into `StorageUnavailable` for the caller.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from contextlib import suppress
from typing import Concatenate, ParamSpec, TypeVar

from courier.storage.records import StorageUnavailable

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")


def served(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """A call the database could not serve (`database or disk is full`, `disk I/O error`, ...) raises
    `StorageUnavailable`, having changed nothing."""

    @functools.wraps(method)
    def serve(storage: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(storage, *args, **kwargs)
        except sqlite3.OperationalError as error:
            raise StorageUnavailable(str(error)) from error

    return serve


class Transaction:
    """BEGIN IMMEDIATE .. COMMIT on `db`; an error in the body or in the COMMIT rolls it back and calls
    `abandoned` (the owner's in-memory counts may include what was just undone)."""

    def __init__(self, db: sqlite3.Connection, abandoned: Callable[[], None]) -> None:
        self._db = db
        self._abandoned = abandoned

    def __enter__(self) -> None:
        if self._db.in_transaction:  # a ROLLBACK that failed left one open; nothing in it was acknowledged
            self._db.execute("ROLLBACK")
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        if kind is None:
            try:
                self._db.execute("COMMIT")
            except BaseException:
                self._abandon()
                raise
            return
        self._abandon()

    def _abandon(self) -> None:
        if self._db.in_transaction:  # SQLite rolls back by itself after some errors (a full disk, an I/O error)
            with suppress(sqlite3.OperationalError):
                self._db.execute("ROLLBACK")
        self._abandoned()
