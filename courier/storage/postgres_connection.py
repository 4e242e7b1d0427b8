"""How the PostgreSQL backend reaches its database: a bounded pool, timeouts, and typed failures.

The storage actor makes one call at a time, so the pool is small; it is bounded so a
slow database can never pile up connections. Every wait is bounded too: connecting,
taking a connection from the pool, and each statement, so a database that is down or
slow makes the call a `StorageUnavailable` (503 with `Retry-After`) within seconds,
and the actor keeps serving everything that needs no storage. Each connection is
checked as it leaves the pool, and a broken one is replaced, so once the database is
back the next call is served, without a restart.

A database that cannot be reached at start-up does not stop the server: `Database`
opens its pool (and prepares the schema, once) on the first call that reaches it,
and until then each call is a `StorageUnavailable`. What is a misconfiguration
rather than an outage stops start-up: a malformed URL, or a login the database
refuses (`LoginRefused`: it asked for a password and did not let us in). Passwords
never reach a log line: the server names the database by `redacted(url)`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from courier.storage.records import StorageUnavailable, UnstorableRecord

logger = logging.getLogger(__name__)

POOL_MIN_SIZE = 1
POOL_MAX_SIZE = 4
# A call waits this long for a connection (the database slow to accept one, or all busy) before it is a 503.
ACQUIRE_TIMEOUT_S = 5.0
# libpq parameters a URL may set itself; these apply where it does not.
CONNECTION_DEFAULTS: dict[str, str | int] = {
    "connect_timeout": 5,
    "application_name": "courier",
    # A database host that vanishes (not one that refuses) is noticed in seconds rather than at TCP's minutes.
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
}
STATEMENT_TIMEOUT_MS = 15_000
RECONNECT_TIMEOUT_S = 2.0
# Until the database is first reached, a call this soon after a failed attempt fails at once with its reason: one
# call waits for a database that does not answer (connect_timeout), not every call queued behind it.
RETRY_INTERVAL_S = 1.0

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")
Prepare = Callable[[psycopg.Connection[Any]], None]


class LoginRefused(Exception):
    """The database answered, asked for a password and refused the login (a wrong password, or an unknown user or
    database): a misconfiguration that retrying does not mend, unlike a database that does not answer."""


class Database:
    """The pool of one database, opened by the first call that reaches the database, which prepares it first.

    Synchronous, one caller at a time (the storage actor's thread), like the backend that owns it.
    """

    def __init__(self, url: str, prepare: Prepare, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.location = redacted(url)
        self._conninfo = conninfo(url)  # a malformed URL raises psycopg.ProgrammingError here, at start-up
        self._prepare = prepare
        self._monotonic = monotonic
        self._pool: ConnectionPool | None = None
        self._failed: tuple[float, str] | None = None  # when the last attempt to open failed, and why

    def try_open(self) -> str | None:
        """Open now if the database answers: None, or why it cannot be reached yet (each call then tries again).
        Raises what is a misconfiguration: `LoginRefused`, or the schema's refusal (`RuntimeError`, a SQL error)."""
        try:
            self._open()
        except psycopg.OperationalError as error:  # nothing listens, no such host, a timeout, "starting up"
            self._failed = (self._monotonic(), _reason(error))
            return self._failed[1]
        return None

    def connection(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection from the pool, which is opened first if need be; `StorageUnavailable` if it cannot be."""
        if self._pool is None:
            self._open_for_call()
        assert self._pool is not None
        return self._pool.connection()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _open_for_call(self) -> None:
        now = self._monotonic()
        if self._failed is not None and now - self._failed[0] < RETRY_INTERVAL_S:
            raise StorageUnavailable(self._failed[1])
        try:
            self._open()
        except (psycopg.Error, LoginRefused, RuntimeError) as error:
            # Once serving, even a misconfiguration found now fails only the calls that need the database.
            self._failed = (now, _reason(error))
            raise StorageUnavailable(self._failed[1]) from error
        logger.info("storage: reached the database %s; requests that need storage are served", self.location)

    def _open(self) -> None:
        """Connect, prepare the database on that connection, then open the pool."""
        try:
            connection = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.OperationalError as error:
            if error.pgconn is not None and error.pgconn.used_password:
                raise LoginRefused(_reason(error)) from error
            raise
        with connection:
            self._prepare(connection)
        self._pool = open_pool(self._conninfo)
        self._failed = None


def redacted(url: str) -> str:
    """`url` without its password, for log lines: postgresql://user@host:port/dbname."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparseable URL)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = parts.get("host") or "localhost"
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{host}{port}/{parts.get('dbname', '')}"


def conninfo(url: str) -> str:
    """`url` with `CONNECTION_DEFAULTS` for what it does not set itself."""
    given = conninfo_to_dict(url)
    return make_conninfo(url, **{key: value for key, value in CONNECTION_DEFAULTS.items() if key not in given})


def open_pool(info: str) -> ConnectionPool:
    """A pool of connections to `info` (a `conninfo`), open and with its first connection made (or `PoolTimeout`)."""
    pool: ConnectionPool = ConnectionPool(
        info,
        min_size=POOL_MIN_SIZE,
        max_size=POOL_MAX_SIZE,
        timeout=ACQUIRE_TIMEOUT_S,
        kwargs={"autocommit": True},  # a write opens its own transaction; a read is one statement
        configure=_configure,
        check=ConnectionPool.check_connection,
        name="courier-storage",
        # The pool's retries back off (1 s, 2 s, 4 s, ...); it gives up after this, and the next call tries at
        # once, so the first call after the database is back waits a second at most, not half the outage.
        reconnect_timeout=RECONNECT_TIMEOUT_S,
        open=False,
    )
    try:
        pool.open(wait=True, timeout=ACQUIRE_TIMEOUT_S)
    except BaseException:
        pool.close()
        raise
    return pool


def _configure(connection: psycopg.Connection[Any]) -> None:
    connection.execute("SELECT set_config('statement_timeout', %s, false)", (str(STATEMENT_TIMEOUT_MS),))


def served(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """A call the database could not serve (down, slow, restarting, out of disk) raises `StorageUnavailable`; its
    transaction, if any, was rolled back, so nothing was changed. A record PostgreSQL cannot hold raises
    `UnstorableRecord`, having changed nothing either."""

    @functools.wraps(method)
    def serve(storage: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(storage, *args, **kwargs)
        except psycopg.DataError as error:
            raise UnstorableRecord(_unstorable(error)) from error
        except (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.ReadOnlySqlTransaction) as error:
            raise StorageUnavailable(_reason(error)) from error

    return serve


def _unstorable(error: psycopg.DataError) -> str:
    reason = _reason(error)
    # Records are JSON, which holds a NUL character escaped ("\u0000"); ids are text, which holds none.
    if "NUL" in reason or "\\u0000" in reason:
        return "the record cannot be stored: an id in it holds a NUL character (\\u0000), which PostgreSQL cannot hold"
    return f"the record cannot be stored in PostgreSQL: {reason}"


def _reason(error: BaseException) -> str:
    """The first line of the error's message (libpq's never holds the password)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
