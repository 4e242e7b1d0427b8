"""A cap on open client connections, which Hypercorn does not have (pgjones/hypercorn#81).

Hypercorn serves each accepted connection with one `TCPServer`. `install_connection_cap`
puts a gate in front of it: a connection accepted while `--max-connections` are open
is answered 503 in the OpenAI envelope (`Retry-After`, `Connection: close`) after its
request head is read, and closed; every other connection counts until it closes. So
a flood of connections costs a bounded number of file descriptors and tasks, and a
client beyond the cap hears why at once, as uvicorn's `--limit-concurrency` answers.

The cap is kept below the process's open-file limit (`cap_for_open_files`): the soft
limit is raised toward the hard one when that leaves room, otherwise the cap is
lowered, with a warning, leaving room for the model's files, the database and logs.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Generator
from contextlib import suppress
from typing import Any

import hypercorn.asyncio.run as hypercorn_run
import orjson
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.typing import WorkerContext as HypercornContext

from courier.core.failure_codes import FailureCode
from courier.http.request_id import mint
from courier.server.client_watch import ConnectionContext, ConnectionWatch, WatchedConnection
from courier.status.connections import ConnectionStats

logger = logging.getLogger(__name__)

# File descriptors kept for everything but client connections: model files, the database, logs, pipes, threads.
RESERVED_FILES = 64
HEAD_LIMIT = 16 * 1024
HEAD_WAIT_S = 2.0
RETRY_AFTER_S = 5
# Hypercorn's asyncio worker looks this class up in its module each time it accepts a connection.
_CONNECTION_SERVER = "TCPServer"


def cap_for_open_files(wanted: int) -> int:
    """`wanted`, or less when the open-file limit cannot hold that many connections beside the reserve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + RESERVED_FILES
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if raised > soft:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    capped = min(wanted, max(1, soft - RESERVED_FILES))
    if capped < wanted:
        logger.warning(
            "--max-connections %d lowered to %d: the open-file limit is %d (raise it with `ulimit -n`)",
            wanted,
            capped,
            soft,
        )
    return capped


def refusal(limit: int, request_id: str) -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "message": f"the server has {limit} open connections, its limit (--max-connections); retry shortly",
                "type": "server_error",
                "param": None,
                "code": FailureCode.OVERLOADED,
            }
        }
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        f"x-request-id: {request_id}\r\n"
        f"request-id: {request_id}\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


def install_connection_cap(
    stats: ConnectionStats,
    watch: ConnectionWatch | None = None,
    on_refused: Callable[[bytes, bytes, str, float], None] | None = None,
) -> Callable[[], None]:
    """Gate every connection Hypercorn accepts until the returned function is called (one server at a time); each
    admitted connection is in `watch` while it is open. `on_refused(head, answer, request_id, seconds)` is told of
    each refused one: the request head read, the answer sent, its request id, and how long that took (the access
    log's line)."""
    serve_connection = getattr(hypercorn_run, _CONNECTION_SERVER)
    if getattr(serve_connection, "courier_gate", False):
        raise RuntimeError("the connection cap is already installed")

    class GatedTCPServer:
        courier_gate = True

        def __init__(self, *arguments: Any) -> None:
            self._arguments = arguments  # Hypercorn's own: (..., reader, writer)

        def __await__(self) -> Generator[Any, None, None]:
            return self._serve().__await__()

        async def _serve(self) -> None:
            reader, writer = self._arguments[-2], self._arguments[-1]
            if stats.open >= stats.limit:
                stats.refused += 1
                started, request_id = time.monotonic(), mint()
                answer = refusal(stats.limit, request_id)
                head = await _refuse(reader, writer, answer)
                if on_refused is not None:
                    on_refused(head, answer, request_id, time.monotonic() - started)
                return
            stats.open += 1
            watched = watch.watch(reader, writer) if watch is not None else None
            try:
                await serve_connection(*_connection_arguments(self._arguments, watched))
            finally:
                stats.open -= 1
                if watch is not None and watched is not None:
                    watch.forget(watched)

    setattr(hypercorn_run, _CONNECTION_SERVER, GatedTCPServer)
    return lambda: setattr(hypercorn_run, _CONNECTION_SERVER, serve_connection)


def _connection_arguments(arguments: tuple[Any, ...], watched: WatchedConnection | None) -> tuple[Any, ...]:
    """Hypercorn's arguments for one connection, its worker context seen through the connection's end."""
    if watched is None:
        return arguments
    return tuple(
        _connection_context(argument, watched.ended) if isinstance(argument, WorkerContext) else argument
        for argument in arguments
    )


def _connection_context(worker: WorkerContext, ended: asyncio.Event) -> HypercornContext:
    return ConnectionContext(worker, ended)  # typed as Hypercorn's protocol, so mypy checks it is one


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: bytes) -> bytes:
    """Read the request head (so the answer is not lost to a reset), answer 503, close; the head read (empty when
    none came in time)."""
    head = b""
    with suppress(Exception):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_WAIT_S)
    with suppress(Exception):
        writer.write(answer)
        await asyncio.wait_for(writer.drain(), HEAD_WAIT_S)
    writer.close()
    with suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), HEAD_WAIT_S)
    return head
