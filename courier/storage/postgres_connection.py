"""How the PostgreSQL backend reaches its database: a bounded pool, timeouts, and typed failures.

The storage actor makes one call at a time, so the pool is small; it is bounded so a
slow database can never pile up connections. Every wait is bounded too: connecting,
taking a connection from the pool, and each statement, so a database that is down or
slow makes the call a `StorageUnavailable` (503 with `Retry-After`) within seconds,
and the actor keeps serving everything that needs no storage. Each connection is
checked as it leaves the pool, and a broken one is replaced, so once the database is
back the next call is served, without a restart. Passwords never reach a log line:
the server names the database by `redacted(url)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from courier.storage.records import StorageRefused, StorageUnavailable

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

P = ParamSpec("P")
S = TypeVar("S")
T = TypeVar("T")


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


def open_pool(url: str) -> ConnectionPool:
    """A pool of connections to `url`, open and with its first connection made (or `PoolTimeout`)."""
    pool: ConnectionPool = ConnectionPool(
        conninfo(url),
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
    transaction, if any, was rolled back, so nothing was changed."""

    @functools.wraps(method)
    def serve(storage: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return method(storage, *args, **kwargs)
        except psycopg.DataError as error:
            # PostgreSQL text and JSONB hold no NUL character: a record with one ("\u0000") cannot be stored at all.
            raise StorageRefused(f"the record cannot be stored in PostgreSQL: {_reason(error)}") from error
        except (psycopg.OperationalError, psycopg.InterfaceError, psycopg.errors.ReadOnlySqlTransaction) as error:
            raise StorageUnavailable(_reason(error)) from error

    return serve


def _reason(error: psycopg.Error) -> str:
    """The first line of libpq's message (which never holds the password)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
