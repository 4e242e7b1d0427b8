"""The actor base and the ask pattern.

An actor owns its state and handles one message at a time from a bounded inbox.
`run` is started with `task_group.start(actor.run, inbox)`: it sets up, starts
its `background` work, reports started, handles messages until the inbox's
senders are all closed, cancels the background work, and on the way
out closes the reply stream of every message it never handled, so no asker waits
forever (their `ask` raises `ActorStopped`). A message's reply stream is closed
after its handler returns or fails, so a handler needs no bookkeeping for that.

A per-request failure the handler expects is its own business: it replies with a
typed failure and the loop goes on. An exception that escapes a handler is a fault
(`runtime/faults.py`): it fails that message's request only, is logged with its
trace and counted, and the loop goes on. Only a `BrokenInvariant` (or a
cancellation) stops the actor and, through the supervisor's task group, the whole
server, loudly.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from typing import Any, ClassVar, Generic, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from courier.runtime.faults import BrokenInvariant, FaultCounter
from courier.runtime.message import Discardable, Message
from courier.runtime.tracing import message_span

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R")

# Replies are one value each; the asker is already waiting on the other end.
REPLY_BUFFER = 1


class ActorStopped(RuntimeError):
    """The actor ended before it answered."""


class ActorBusy(RuntimeError):
    """The actor's inbox is full: the caller should shed load (HTTP 503)."""


class Actor(ABC, Generic[M]):
    name: ClassVar[str]
    _faults: FaultCounter | None = None

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[M],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
        faults: FaultCounter | None = None,
    ) -> None:
        self._faults = faults
        async with inbox:
            try:
                await self.setup()
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(self.background)
                    task_status.started()
                    async for message in inbox:
                        with message_span(self.name, message, message.trace):
                            try:
                                await self.handle(message)
                            except BrokenInvariant:
                                raise
                            except Exception as error:
                                self.fault(message, error, getattr(message, "reply", None))
                            finally:
                                # Even a handler cancelled before it replied leaves no asker waiting.
                                _close_reply(message)
                    task_group.cancel_scope.cancel()
            finally:
                _refuse_unhandled(inbox)
                self.stopped()

    def fault(self, message: M, error: Exception, reply: MemoryObjectSendStream[Any] | None) -> None:
        """`message`'s handling raised `error`: log it with its trace, count it, and answer its asker on `reply`."""
        span = trace.get_current_span()
        span.record_exception(error)
        span.set_status(StatusCode.ERROR, type(error).__name__)
        trace_id = format(span.get_span_context().trace_id, "032x")
        logger.error(
            "%s: handling %s raised %s; that request fails, the actor keeps serving (trace %s)",
            self.name,
            type(message).__name__,
            type(error).__name__,
            trace_id,
            exc_info=error,
        )
        if self._faults is not None:
            self._faults.add(self.name)
        failed = getattr(message, "failed", None)
        if reply is not None and callable(failed):
            with suppress(anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                reply.send_nowait(failed(error, self.name))

    async def setup(self) -> None:
        """Prepare state before the actor reports itself started."""

    async def background(self) -> None:
        """Work the actor does beside its inbox (a drive loop, a periodic tick); cancelled when the inbox ends."""

    def stopped(self) -> None:
        """Last words once the actor has stopped handling messages, however it stopped."""

    @abstractmethod
    async def handle(self, message: M) -> None:
        """Handle one message; reply on its reply stream where it has one."""


async def ask(
    outbox: MemoryObjectSendStream[M],
    build: Callable[[MemoryObjectSendStream[R]], M],
) -> R:
    """Send the message `build(reply_stream)` and wait for its one reply.

    Never waits for inbox room: a full inbox raises `ActorBusy` at once.
    """
    reply_send, reply_receive = anyio.create_memory_object_stream[R](REPLY_BUFFER)
    with reply_receive:
        try:
            outbox.send_nowait(build(reply_send))
        except anyio.WouldBlock:
            reply_send.close()
            raise ActorBusy("the actor's inbox is full") from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            reply_send.close()
            raise ActorStopped("the actor is not running") from None
        received: list[R] = []
        try:
            # The wait runs in a task of its own. asyncio's native cancellation (Quart cancels a request's handler
            # so when its client leaves) can land after the actor handed the reply to a waiting receive() but
            # before that task resumed, and anyio's receive() then drops it: a lease never given back, an admitted
            # generation left running for nobody. A task group delivers a cancellation to its tasks only while
            # they wait on something not yet done, so the child keeps a reply handed to it, and it is released.
            async with anyio.create_task_group() as waiting:
                waiting.start_soon(_receive_into, reply_receive, received)
        except BaseException:  # cancelled: a reply received, or waiting in the buffer, is nobody's
            for reply in received:
                if isinstance(reply, Discardable):
                    reply.discard()
            discard_unreceived(reply_receive)
            raise
        if not received:
            raise ActorStopped("the actor stopped before answering")
        return received[0]


async def _receive_into(replies: MemoryObjectReceiveStream[R], received: list[R]) -> None:
    """The one reply, into `received` (left empty when the actor closed the stream without one)."""
    with suppress(anyio.EndOfStream):
        received.append(await replies.receive())


def discard_unreceived(replies: MemoryObjectReceiveStream[Any]) -> None:
    """Release a reply left in `replies` that no asker will read (see `Discardable`)."""
    with suppress(anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
        reply = replies.receive_nowait()
        if isinstance(reply, Discardable):
            reply.discard()


def _refuse_unhandled(inbox: MemoryObjectReceiveStream[M]) -> None:
    while True:
        try:
            message = inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return
        _close_reply(message)


def _close_reply(message: Message) -> None:
    reply = getattr(message, "reply", None)
    if isinstance(reply, MemoryObjectSendStream):
        reply.close()
