"""Driving one actor over real anyio streams, with small hand-written fakes of its neighbours.

`run_actor` starts the actor on a real inbox (the same `Actor.run` the supervisor
starts) and closes the inbox on the way out, which is how the server stops it.
A `FakeNeighbour` stands in for an actor the one under test talks to: it records
every message it receives, in order, and answers each with whatever its `answer`
function returns (nothing for a tell). A neighbour can be busy (its inbox full, so
an ask raises `ActorBusy` at once) or stopped (its inbox closed, so an ask raises
`ActorStopped`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.runtime.actor import Actor
from courier.runtime.faults import FaultCounter
from courier.runtime.message import Message

M = TypeVar("M", bound=Message)
N = TypeVar("N", bound=Message)

INBOX = 16


@asynccontextmanager
async def run_actor(
    actor: Actor[M], capacity: int = INBOX, *, faults: FaultCounter | None = None
) -> AsyncIterator[MemoryObjectSendStream[M]]:
    """The actor running on a fresh inbox (counting its faults into `faults`); yields the inbox's send side.
    Leaving closes it and waits for the actor."""
    send, receive = anyio.create_memory_object_stream[M](capacity)
    async with anyio.create_task_group() as tasks:
        await tasks.start(partial(actor.run, faults=faults), receive)
        with send:
            yield send


Answer = Callable[[N], Any | Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer that is itself None (a storage write's): `answer` returns `Reply(None)` to send it."""

    value: Any


class FakeNeighbour(Generic[N]):
    """An actor's neighbour: records what it receives, answers with `answer(message)` on the message's reply.

    `answer` may be async (to hold an answer back until the test lets it go); returning None sends nothing,
    `Reply(value)` sends `value` (None included). The reply stream is closed after `answer` returns, as the actor
    base closes it after a handler, so an unanswered asker gets `ActorStopped` rather than hanging.
    """

    def __init__(self, answer: Answer[N] | None = None, capacity: int = INBOX) -> None:
        self.send, self._receive = anyio.create_memory_object_stream[N](capacity)
        self._answer = answer
        self.received: list[N] = []
        self.arrived = anyio.Event()  # set at each arrival; `wait_for` replaces it

    @property
    def kinds(self) -> list[str]:
        """The received messages' type names, in order."""
        return [type(message).__name__ for message in self.received]

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the inbox until it closes or the task is cancelled; then the neighbour's inbox is closed too."""
        with self._receive, self.send:
            task_status.started()
            async for message in self._receive:
                self.received.append(message)
                self.arrived.set()
                reply: MemoryObjectSendStream[Any] | None = getattr(message, "reply", None)
                try:
                    await self._reply(message, reply)
                finally:
                    if reply is not None:  # as the actor base does: answered or not, the asker never hangs
                        reply.close()

    async def wait_for(self, count: int) -> None:
        """Until at least `count` messages have arrived (events, never sleeps)."""
        while len(self.received) < count:
            self.arrived = anyio.Event()
            await self.arrived.wait()

    def stop(self) -> None:
        """The neighbour is gone: asks to it raise `ActorStopped` from now on."""
        self._receive.close()

    async def _reply(self, message: N, reply: MemoryObjectSendStream[Any] | None) -> None:
        if self._answer is None:
            return
        answer = self._answer(message)
        if isinstance(answer, Awaitable):
            answer = await answer
        if isinstance(answer, Reply):
            answer = answer.value
        elif answer is None:
            return
        if reply is not None:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await reply.send(answer)


@contextmanager
def busy_inbox() -> Iterator[MemoryObjectSendStream[Any]]:
    """An inbox with no room and no reader: an ask to it raises `ActorBusy` at once, a tell is dropped."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    with send, receive:
        yield send


def stopped_inbox() -> MemoryObjectSendStream[Any]:
    """An inbox whose actor has stopped: an ask to it raises `ActorStopped` at once, a tell is dropped."""
    send, receive = anyio.create_memory_object_stream[Any](INBOX)
    receive.close()
    return send


async def start_neighbours(tasks: TaskGroup, *neighbours: FakeNeighbour[Any]) -> None:
    for neighbour in neighbours:
        await tasks.start(neighbour.serve)
