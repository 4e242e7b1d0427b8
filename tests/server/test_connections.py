"""Slow, idle and many connections: a body must arrive within --body-timeout, an idle connection is kept for
--keep-alive-timeout (and no longer than its client keeps it), and open connections are capped.

Raw sockets, because the point is what a client that misbehaves at the connection
level gets: a trickled body is cut with a 408 however steadily it trickles, and a
connection past --max-connections hears 503 at once and is closed, while the ones
already open keep working and a freed slot is taken again.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from openai._constants import DEFAULT_CONNECTION_LIMITS as OPENAI_POOL

from courier.settings import Settings
from tests.support.polling import attempts
from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
MAX_CONNECTIONS = 3
TIMEOUT_S = 30.0
KEEP_ALIVE_S = 1.0


@pytest.fixture
def capped(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    # Idle connections are kept far longer than the test waits, so only the client's close can free a slot.
    arguments = ("--max-connections", str(MAX_CONNECTIONS), "--keep-alive-timeout", "600")
    with serving(tiny_llama_dir, cache_dir, MODEL, *arguments) as running:
        yield running


@pytest.fixture
def impatient(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    arguments = ("--body-timeout", "1", "--keep-alive-timeout", str(KEEP_ALIVE_S))
    with serving(tiny_llama_dir, cache_dir, MODEL, *arguments) as running:
        yield running


def connect(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    connection = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    return connection


def get_health(connection: socket.socket) -> tuple[bytes, dict[str, object]]:
    """One keep-alive request on `connection`: its status line and JSON body."""
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: courier\r\n\r\n")
    head, body = read_response(connection)
    return head.split(b"\r\n", 1)[0], orjson.loads(body)


def counted(*, open_: int, refused: int) -> dict[str, int]:
    """`/health`'s `connections` with `open_` connections open and `refused` refused (no client gone)."""
    return {"limit": MAX_CONNECTIONS, "open": open_, "refused": refused, "client_gone": 0}


def read_response(connection: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
        0,
    )
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            break
        body += chunk
    return head, body


@pytest.fixture
def held(capped: RunningServer) -> Iterator[list[socket.socket]]:
    """As many keep-alive connections to `capped` as its cap, each answered once and idle."""
    connections = [connect(capped) for _ in range(MAX_CONNECTIONS)]
    try:
        for connection in connections:
            status, health = get_health(connection)
            assert status.startswith(b"HTTP/1.1 200")
        assert health["connections"] == counted(open_=MAX_CONNECTIONS, refused=0)
        yield connections
    finally:
        for connection in connections:
            connection.close()


def test_connections_past_the_cap_hear_503_and_a_freed_slot_is_taken_again(
    capped: RunningServer, held: list[socket.socket]
) -> None:
    server = capped
    with connect(server) as extra:
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: courier\r\n\r\n")
        head, body = read_response(extra)
        assert head.startswith(b"HTTP/1.1 503")
        assert b"connection: close" in head.lower() and b"retry-after" in head.lower()
        assert orjson.loads(body)["error"]["code"] == "overloaded"
        assert extra.recv(1) == b""  # and it is closed
    # Refused before the application saw it, and still one line in the access log.
    refused = server.logged(re.compile(r"courier\.access: (method=GET path=/health status=503 .*)")).group(1)
    assert f" bytes={len(body)} " in refused and " error=overloaded " in refused, refused
    [request_id] = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n") if line.startswith(b"x-request-id")]
    assert f" id={request_id.decode()} " in refused, refused  # the id the refused client was told
    # One connection ends (the server closes it after answering `Connection: close`): its slot is free again.
    leaving = held.pop()
    leaving.sendall(b"GET /health HTTP/1.1\r\nHost: courier\r\nConnection: close\r\n\r\n")
    read_response(leaving)
    assert leaving.recv(1) == b""
    leaving.close()
    watcher = held[0]
    for _ in range(100):  # the server counts the connection out as it finishes closing it: a request or two
        _, health = get_health(watcher)
        if health["connections"] == counted(open_=MAX_CONNECTIONS - 1, refused=1):
            break
    assert health["connections"] == counted(open_=MAX_CONNECTIONS - 1, refused=1)
    with connect(server) as again:
        status, _ = get_health(again)
        assert status.startswith(b"HTTP/1.1 200")


def test_a_trickled_body_is_cut_at_the_body_timeout(impatient: RunningServer) -> None:
    server = impatient
    body_length = 1000  # at a byte per 0.2 s the whole body would take 200 s
    with connect(server) as slow:
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: courier\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {body_length}\r\n\r\n".encode()
        )
        answered = threading.Event()

        def trickle() -> None:
            for _ in range(body_length):
                if answered.wait(0.2):  # the slow client's own pace
                    return
                try:
                    slow.sendall(b" ")
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        head, body = read_response(slow)
        answered.set()
        sender.join(TIMEOUT_S)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"connection: close" in head.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == "body_timeout"
    assert "--body-timeout" in error["message"]


def test_a_connection_its_client_closed_between_requests_frees_its_slot_at_once(
    capped: RunningServer, held: list[socket.socket]
) -> None:
    """Hypercorn alone held such a connection until its keep-alive timer ran out, counted against the cap."""
    held.pop().close()  # idle, between requests: the server hears only the close
    watcher = held[0]
    for _ in attempts(TIMEOUT_S):
        _, health = get_health(watcher)
        if health["connections"] == counted(open_=MAX_CONNECTIONS - 1, refused=0):
            break
    else:
        raise AssertionError(f"the closed connection is still counted: {health}")
    with connect(capped) as again:  # its slot is taken again
        status, _ = get_health(again)
        assert status.startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_closed_at_the_keep_alive_timeout(impatient: RunningServer) -> None:
    with connect(impatient) as idle:
        asked = time.monotonic()  # the server's timer starts after this, once it has answered
        status, _ = get_health(idle)
        assert status.startswith(b"HTTP/1.1 200")
        assert idle.recv(1) == b""  # the server closed it (the socket's own timeout is TIMEOUT_S)
        # Hypercorn's own default is 5 s: well past the bound, so the flag is what closed it.
        assert KEEP_ALIVE_S <= time.monotonic() - asked < 4.5


def test_the_keep_alive_timeout_outlasts_the_sdks_connection_pools() -> None:
    """A client that sends on a pooled connection just as the server closes it gets a reset, which the SDKs raise
    when retries are off; a server that keeps idle connections longer than the client pools them never races."""
    from anthropic._constants import DEFAULT_CONNECTION_LIMITS as ANTHROPIC_POOL  # imported by the tests that use it

    pools = (OPENAI_POOL.keepalive_expiry, ANTHROPIC_POOL.keepalive_expiry)
    assert all(expiry is not None and Settings().keep_alive_timeout > expiry for expiry in pools)
