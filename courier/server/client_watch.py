"""Clients that went away while their request is answered, which Hypercorn does not report until it writes.

Hypercorn reads nothing more from an HTTP/1.1 connection while it answers a request (h11 pauses until the
response is sent), so a client that sends a request and disconnects was noticed only when the answer was written:
a non-streamed chat ran its whole generation for nobody, and a storm of such requests filled the batch for tens
of seconds. The connection gate (`server/connection_cap.py`) registers each connection here, and the transport's
end of it (EOF or a reset) sets an event. `ClientGoneMiddleware` answers the app's next `receive()` with
`http.disconnect` as soon as that event is set, so Quart cancels the request's handler, as it does when Hypercorn
reports a disconnect; the handler's cancellation closes the generation's event stream, which takes it out of the
queue or the batch at the scheduler's next step. A client that half-closes its side and still waits for the answer
(rare; uvicorn treats it alike) is taken as gone too, and gets no answer: Hypercorn itself ends the request's stream
when it reads the client's EOF.

Hypercorn also kept a connection its client had closed while it was idle (between requests): its idle timer holds
the connection until `--keep-alive-timeout`, so each such connection counted against `--max-connections` and held
a file descriptor for that long. `ConnectionContext` gives each connection its own view of Hypercorn's worker
context, whose `terminated` is set when the worker's is or when the client has gone: the idle timer then closes the
connection at once, and a connection whose client has gone is closed after its answer instead of kept for another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.typing import Event, SingleTask

from courier.http.asgi import Receive, Scope, Send
from courier.status.connections import ConnectionStats

Peer = tuple[str, int]

DISCONNECT = {"type": "http.disconnect"}


@dataclass(frozen=True, slots=True)
class WatchedConnection:
    peer: Peer
    ended: asyncio.Event  # set when its client has closed or reset it


class ConnectionWatch:
    """Each open connection's end, as an event, by the client's address (the ASGI scope's `client`)."""

    def __init__(self) -> None:
        self._ended: dict[Peer, asyncio.Event] = {}

    def __len__(self) -> int:
        return len(self._ended)

    def watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> WatchedConnection | None:
        """Start watching a connection (None: its peer has no address to find it by, as a Unix socket's)."""
        peer = _peer(writer.get_extra_info("peername"))
        if peer is None:
            return None
        ended = asyncio.Event()
        feed_eof, set_exception = reader.feed_eof, reader.set_exception

        def eof() -> None:
            feed_eof()
            ended.set()

        def failed(error: Exception) -> None:
            set_exception(error)
            ended.set()

        # The transport's protocol calls these on the reader when the peer closes or resets the connection.
        setattr(reader, "feed_eof", eof)  # noqa: B010
        setattr(reader, "set_exception", failed)  # noqa: B010
        # Under load the client's request and its close can both arrive before Hypercorn's task for the connection
        # runs: the EOF is then fed already, with the request still buffered, which `at_eof()` does not report.
        if getattr(reader, "_eof", False) or reader.at_eof() or reader.exception() is not None:
            ended.set()
        self._ended[peer] = ended
        return WatchedConnection(peer, ended)

    def forget(self, connection: WatchedConnection) -> None:
        """Stop watching `connection`. On loopback a client's port is reused at once, so a new connection from the
        same address may be watched already, before the old one's task ends: its entry stays."""
        if self._ended.get(connection.peer) is connection.ended:
            del self._ended[connection.peer]

    def ended(self, client: Any) -> asyncio.Event | None:
        peer = _peer(client)
        return self._ended.get(peer) if peer is not None else None


class ConnectionContext:
    """Hypercorn's worker context (`hypercorn.typing.WorkerContext`) as one connection sees it: terminated when the
    worker is, or once the connection's client has gone."""

    def __init__(self, worker: WorkerContext, ended: asyncio.Event) -> None:
        self._worker = worker
        self.event_class: type[Event] = worker.event_class
        self.single_task_class: type[SingleTask] = worker.single_task_class
        self.terminate: Event = worker.terminate
        self.terminated: Event = GoneOrTerminated(worker.terminated, ended)

    async def mark_request(self) -> None:
        await self._worker.mark_request()

    @staticmethod
    async def sleep(wait: float) -> None:
        await WorkerContext.sleep(wait)

    @staticmethod
    def time() -> float:
        return WorkerContext.time()


class GoneOrTerminated:
    """A `hypercorn.typing.Event` set while the worker is terminated or the connection's client has gone."""

    def __init__(self, terminated: Event, ended: asyncio.Event) -> None:
        self._terminated = terminated
        self._ended = ended

    def is_set(self) -> bool:
        return self._ended.is_set() or self._terminated.is_set()

    async def wait(self) -> None:
        if self.is_set():
            return
        waits = {asyncio.ensure_future(self._terminated.wait()), asyncio.ensure_future(self._ended.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()

    async def set(self) -> None:
        """Hypercorn sets and clears only the worker's own event; a connection's end comes from its client."""
        raise RuntimeError("a connection's view of the worker's terminated event is read-only")

    async def clear(self) -> None:
        raise RuntimeError("a connection's view of the worker's terminated event is read-only")


class ClientGoneMiddleware:
    """An ASGI layer that tells the app `http.disconnect` once its request's connection has ended."""

    def __init__(
        self, app: Callable[[Scope, Receive, Send], Awaitable[None]], watch: ConnectionWatch, stats: ConnectionStats
    ) -> None:
        self._app = app
        self._watch = watch
        self._stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = self._watch.ended(scope.get("client")) if scope.get("type") == "http" else None
        if ended is None:
            await self._app(scope, receive, send)
            return

        told = answered = False

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal answered
            await send(message)
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                answered = True  # a client that leaves after this left nothing undone

        async def receive_or_gone() -> MutableMapping[str, Any]:
            nonlocal told
            message: MutableMapping[str, Any] | None = None
            if not ended.is_set():
                receiving = asyncio.ensure_future(receive())
                ending = asyncio.ensure_future(ended.wait())
                try:
                    await asyncio.wait({receiving, ending}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ending.cancel()
                if receiving.done():
                    message = receiving.result()
                else:
                    receiving.cancel()
            if message is None:
                message = dict(DISCONNECT)
            # Hypercorn may say so first: it closes a connection whose client has gone once it is idle (before the
            # request is read, the request still buffered), and the request's stream with it.
            if message.get("type") == "http.disconnect" and not (told or answered):
                told = True
                self._stats.client_gone += 1
            return message

        await self._app(scope, receive_or_gone, sending)


def _peer(address: Any) -> Peer | None:
    if isinstance(address, list | tuple) and len(address) >= 2 and isinstance(address[1], int):
        return (str(address[0]), address[1])
    return None
