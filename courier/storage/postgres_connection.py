"""How the PostgreSQL backend reaches its database: a bounded pool, timeouts, and typed failures.

The storage actor makes up to `POOL_MAX_SIZE` calls at once, so a slow statement does
not hold up the others; the pool is bounded so a slow database can never pile up
connections. Every wait is bounded too: connecting, taking a connection from the pool,
and each statement, so a database that is slow makes the call a `StorageUnavailable`
(503 with `Retry-After`) within seconds, and the actor keeps serving everything that
needs no storage. A database that cannot be reached is `StorageUnreachable`, found at
once: each connection is checked as it leaves the pool, and a dead one costs one
connection attempt, not the pool's retries. A refused attempt closes the pool, which
fails every call waiting on it; the storage actor's breaker then refuses calls at once
until its probe (`Database.reach`) connects again. A database that merely restarted
is reconnected within the call that finds out.

A database that cannot be reached at start-up does not stop the server: `Database`
opens its pool (and prepares the schema, once) on the first call that reaches it,
and until then each call is a `StorageUnreachable`. What is a misconfiguration
rather than an outage stops start-up: a malformed URL, or a login the database
refuses (`LoginRefused`: it asked for a password and did not let us in). Passwords
never reach a log line: the server names the database by `redacted(url)`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from courier.storage.records import StorageUnavailable, StorageUnreachable, UnstorableRecord

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
# A call this soon after a failed attempt to open fails at once with its reason: one call waits for a database that
# does not answer (connect_timeout), not every call queued behind it. The breaker's probe (`reach`) is not held back.
RETRY_INTERVAL_S = 1.0
# How long closing a lost pool waits for its workers (each at most one connection attempt into a database that
# refuses, so at once; one into a vanished host is left to finish by itself).
POOL_CLOSE_TIMEOUT_S = 1.0

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")
Prepare = Callable[[psycopg.Connection[Any]], None]


class LoginRefused(Exception):
    """The database answered, asked for a password and refused the login (a wrong password, or an unknown user or
    database): a misconfiguration that retrying does not mend, unlike a database that does not answer."""


class Database:
    """The pool of one database: opened by the first call that reaches the database (which prepares it first), and
    dropped as soon as a call finds the database gone, so the calls waiting on it fail at once.

    Thread-safe: the storage actor makes up to `POOL_MAX_SIZE` calls at once, each on a thread of its own. A call
    that cannot get a working connection raises `StorageUnreachable`: the pool could not hand one over in time,
    the one it handed over was dead and no new one could be made, or the connection broke during the call. The pool
    is then closed, which fails every call waiting on it (`PoolClosed`) instead of letting each wait
    `ACQUIRE_TIMEOUT_S`; the next call to reach the database opens a new one (`reach` is the breaker's probe).
    """

    def __init__(self, url: str, prepare: Prepare, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.location = redacted(url)
        self._conninfo = conninfo(url)  # a malformed URL raises psycopg.ProgrammingError here, at start-up
        self._prepare = prepare
        self._monotonic = monotonic
        self._state = threading.Lock()  # held briefly: `_pool` and `_failed`
        self._opening = threading.Lock()  # one opener at a time (it connects while holding it)
        self._pool: ConnectionPool | None = None
        self._failed: tuple[float, str] | None = None  # when the last attempt to open failed, and why

    def try_open(self) -> str | None:
        """Open now if the database answers: None, or why it cannot be reached yet (each call then tries again).
        Raises what is a misconfiguration: `LoginRefused`, or the schema's refusal (`RuntimeError`, a SQL error)."""
        with self._opening:
            try:
                self._open()
            except psycopg.OperationalError as error:  # nothing listens, no such host, a timeout, "starting up"
                return self._opening_failed(error)
        return None

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A working connection from the pool, which is opened first if need be; `StorageUnreachable` if there is
        none to be had (or it breaks while in use)."""
        pool = self._pool_for_call(probe=False)
        connection = self._acquire(pool)
        try:
            yield connection
        except (psycopg.OperationalError, psycopg.InterfaceError) as error:
            if connection.broken:  # the database went away mid-call (stopped, restarted, the network lost)
                raise self._lost(pool, error) from error
            raise  # slow (a statement timeout), read-only, ...: the database is there
        finally:
            pool.putconn(connection)

    def reach(self) -> None:
        """Connect now, however recently an attempt failed (the breaker's probe); `StorageUnreachable` if it cannot."""
        self._pool_for_call(probe=True)
        with self.connection() as connection:
            connection.execute("")

    def close(self) -> None:
        with self._state:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _pool_for_call(self, *, probe: bool) -> ConnectionPool:
        with self._state:
            if self._pool is not None:
                return self._pool
            failed = self._failed
        if not probe and failed is not None and self._monotonic() - failed[0] < RETRY_INTERVAL_S:
            raise StorageUnreachable(failed[1])
        with self._opening:
            if self._pool is not None:  # another call opened it meanwhile
                return self._pool
            try:
                pool = self._open()
            except (psycopg.Error, LoginRefused, RuntimeError) as error:
                # Once serving, even a misconfiguration found now fails only the calls that need the database.
                raise StorageUnreachable(self._opening_failed(error)) from error
        logger.info("storage: reached the database %s; requests that need storage are served", self.location)
        return pool

    def _acquire(self, pool: ConnectionPool) -> psycopg.Connection[Any]:
        """A connection from `pool` that answers. A dead one (its server stopped, or restarted since) is replaced if
        the database can be reached; if it cannot, the pool is lost."""
        try:
            return self._checked(pool)
        except psycopg.Error:
            pass
        try:  # gone, or restarted? One connection attempt says (within connect_timeout)
            psycopg.connect(self._conninfo).close()
        except psycopg.Error as error:
            raise self._lost(pool, error) from error
        pool.check()  # restarted: the connections it kept are as dead as that one
        try:
            return self._checked(pool)
        except psycopg.Error as error:
            raise self._lost(pool, error) from error

    def _checked(self, pool: ConnectionPool) -> psycopg.Connection[Any]:
        """A connection from `pool`, checked: the check's error if it is dead (it is then discarded)."""
        try:
            connection = pool.getconn()
        except psycopg.OperationalError as error:  # PoolTimeout: none within ACQUIRE_TIMEOUT_S; PoolClosed: lost
            raise self._lost(pool, error) from error
        try:
            ConnectionPool.check_connection(connection)
        except BaseException:
            pool.putconn(connection)  # a broken connection is closed, and the pool makes another
            raise
        return connection

    def _lost(self, pool: ConnectionPool, error: BaseException) -> StorageUnreachable:
        """The database cannot be reached through `pool`: close it (failing every call waiting on it at once) so
        the next call opens a new one. Returns the error to raise."""
        reason = _reason(error)
        with self._state:
            current = self._pool is pool
            if current:
                self._pool = None
                self._failed = (self._monotonic(), reason)
        if current:
            pool.close(timeout=POOL_CLOSE_TIMEOUT_S)
        return StorageUnreachable(reason)

    def _opening_failed(self, error: BaseException) -> str:
        reason = _reason(error)
        with self._state:
            self._failed = (self._monotonic(), reason)
        return reason

    def _open(self) -> ConnectionPool:
        """Connect, prepare the database on that connection, then open the pool (the caller holds `_opening`)."""
        try:
            connection = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.OperationalError as error:
            if error.pgconn is not None and error.pgconn.used_password:
                raise LoginRefused(_reason(error)) from error
            raise
        with connection:
            self._prepare(connection)
        pool = open_pool(self._conninfo)
        with self._state:
            self._pool = pool
            self._failed = None
        return pool


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
        # No `check`: `Database._acquire` checks each connection itself, so a dead one means one connection attempt,
        # not the pool's retries until ACQUIRE_TIMEOUT_S.
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
