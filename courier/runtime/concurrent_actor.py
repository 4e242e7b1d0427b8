"""An actor whose requests run concurrently: each message is served in its own task, up to a bound.

For actors whose work is mostly waiting (a summary generation, a remote fetch):
one slow request must not hold up the others. The inbox is still read one
message at a time; when `max_concurrent` requests are in flight, reading waits,
so a full inbox turns into `ActorBusy` for callers rather than unbounded tasks.
Each request's reply goes on its own clone of the reply stream (the base closes
the original when `handle` returns), so every asker gets exactly one answer, or
`ActorStopped` when the actor stops first.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import suppress
from typing import Any, ClassVar, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.messages.base import Message
from courier.runtime.actor import Actor

M = TypeVar("M", bound=Message)


class ConcurrentActor(Actor[M]):
    max_concurrent: ClassVar[int]

    def __init__(self) -> None:
        self._slots = anyio.Semaphore(self.max_concurrent)
        self._tasks: TaskGroup | None = None
        self._ready = anyio.Event()

    async def background(self) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            self._ready.set()
            await anyio.sleep_forever()

    async def handle(self, message: M) -> None:
        await self._ready.wait()
        assert self._tasks is not None
        reply: MemoryObjectSendStream[Any] = message.reply.clone()  # type: ignore[attr-defined]
        await self._slots.acquire()
        self._tasks.start_soon(self._serve_and_reply, message, reply)

    async def _serve_and_reply(self, message: M, reply: MemoryObjectSendStream[Any]) -> None:
        with reply:
            try:
                result = await self.serve(message)
            finally:
                self._slots.release()
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await reply.send(result)

    @abstractmethod
    async def serve(self, message: M) -> Any:
        """The reply to `message` (a typed failure for a per-request failure; anything raised stops the actor)."""
