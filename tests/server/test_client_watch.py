"""The layer that tells a request its client has gone, and the connection's view of Hypercorn's worker context,
driven in-process: the races a storm of clients makes under load, made to happen on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any, cast

import pytest
from hypercorn.asyncio.worker_context import WorkerContext

from courier.server.client_watch import ClientGoneMiddleware, ConnectionContext, ConnectionWatch, WatchedConnection
from courier.status.connections import ConnectionStats

PEER = ("127.0.0.1", 40000)
SCOPE = {"type": "http", "client": PEER}


class Peer:
    """What the watch reads of an asyncio StreamWriter: the peer's address."""

    def get_extra_info(self, name: str) -> object:
        return PEER if name == "peername" else None


def watched(watch: ConnectionWatch | None = None) -> tuple[asyncio.StreamReader, WatchedConnection]:
    """A new connection's reader, watched by `watch` (a watch of its own by default)."""
    reader = asyncio.StreamReader()
    connection = (ConnectionWatch() if watch is None else watch).watch(reader, cast(asyncio.StreamWriter, Peer()))
    assert connection is not None
    return reader, connection


async def run_app(
    watch: ConnectionWatch, stats: ConnectionStats, hypercorn_says: list[dict[str, Any]], *, answer_first: bool
) -> list[MutableMapping[str, Any]]:
    """An app that (optionally answers, then) reads until told of a disconnect, behind the middleware; Hypercorn's
    receive hands out `hypercorn_says`."""
    heard: list[MutableMapping[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if answer_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        while not heard or heard[-1]["type"] != "http.disconnect":
            heard.append(await receive())

    async def receive() -> dict[str, Any]:
        if hypercorn_says:
            return hypercorn_says.pop(0)
        await asyncio.Event().wait()  # nothing more comes: the middleware cancels this when the client has gone
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        return None

    await asyncio.wait_for(ClientGoneMiddleware(app, watch, stats)(SCOPE, receive, send), 5)
    return heard


@pytest.mark.anyio
async def test_a_disconnect_hypercorn_tells_first_is_counted_as_the_client_gone() -> None:
    """Hypercorn closes a gone client's idle connection, and the stream with it, sometimes before the watch hears
    the end: its own `http.disconnect` reaches the app first. One in ~200 storm requests went uncounted."""
    watch, stats = ConnectionWatch(), ConnectionStats(limit=8)
    watched(watch)
    says: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"{}", "more_body": False},
        {"type": "http.disconnect"},
    ]
    heard = await run_app(watch, stats, says, answer_first=False)
    assert [message["type"] for message in heard] == ["http.request", "http.disconnect"]
    assert stats.client_gone == 1


@pytest.mark.anyio
async def test_the_watch_tells_of_a_close_hypercorn_has_not_reported() -> None:
    watch, stats = ConnectionWatch(), ConnectionStats(limit=8)
    reader, connection = watched(watch)
    reader.feed_data(b"GET / HTTP/1.1\r\n\r\n")
    reader.feed_eof()  # the client closed; Hypercorn, answering, reads nothing yet
    assert connection.ended.is_set()
    heard = await run_app(watch, stats, [], answer_first=False)
    assert [message["type"] for message in heard] == ["http.disconnect"]
    assert stats.client_gone == 1


@pytest.mark.anyio
async def test_a_client_that_closed_before_its_connection_was_watched_is_seen_gone() -> None:
    """Under load the request and the close can both be read before Hypercorn's task for the connection runs."""
    reader = asyncio.StreamReader()
    reader.feed_data(b"GET / HTTP/1.1\r\n\r\n")
    reader.feed_eof()
    assert not reader.at_eof()  # the request is still buffered
    connection = ConnectionWatch().watch(reader, cast(asyncio.StreamWriter, Peer()))
    assert connection is not None and connection.ended.is_set()


@pytest.mark.anyio
async def test_a_client_that_leaves_after_its_answer_is_not_counted_as_gone() -> None:
    watch, stats = ConnectionWatch(), ConnectionStats(limit=8)
    watched(watch)
    heard = await run_app(watch, stats, [{"type": "http.disconnect"}], answer_first=True)
    assert [message["type"] for message in heard] == ["http.disconnect"]
    assert stats.client_gone == 0


@pytest.mark.anyio
async def test_an_old_connection_forgotten_late_leaves_the_new_one_from_its_address_watched() -> None:
    """On loopback a client's port is reused at once: the new connection is watched before the old one's task
    has ended and forgotten it."""
    watch = ConnectionWatch()
    old = watch.watch(asyncio.StreamReader(), cast(asyncio.StreamWriter, Peer()))
    new = watch.watch(asyncio.StreamReader(), cast(asyncio.StreamWriter, Peer()))
    assert old is not None and new is not None
    watch.forget(old)
    assert watch.ended(PEER) is new.ended
    watch.forget(new)
    assert watch.ended(PEER) is None


@pytest.mark.anyio
async def test_a_connection_sees_the_worker_terminated_once_its_client_has_gone() -> None:
    """So Hypercorn's idle timer closes it at once and it is not kept for another request."""
    worker = WorkerContext(None)
    reader, connection = watched()
    context = ConnectionContext(worker, connection.ended)
    waiting = asyncio.ensure_future(context.terminated.wait())
    await asyncio.sleep(0)
    assert not context.terminated.is_set() and not waiting.done()
    reader.feed_eof()
    await asyncio.wait_for(waiting, 5)
    assert context.terminated.is_set() and not worker.terminated.is_set()
    other = ConnectionContext(worker, watched()[1].ended)
    await worker.terminated.set()  # the server is stopping: every connection sees it
    assert other.terminated.is_set()
    await asyncio.wait_for(other.terminated.wait(), 5)


@pytest.mark.anyio
async def test_a_wait_cancelled_by_hypercorn_leaves_no_task_behind() -> None:
    """Hypercorn's idle timer waits with a timeout, and a new request cancels it."""
    terminated = ConnectionContext(WorkerContext(None), watched()[1].ended).terminated
    before = asyncio.all_tasks()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(terminated.wait(), 0.01)
    await asyncio.sleep(0)  # the cancelled waiters finish
    assert asyncio.all_tasks() == before
