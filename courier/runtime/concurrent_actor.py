"""Work beside an actor's inbox loop: `SideTasks`, and `ConcurrentActor`, whose every request runs that way.

For work that is mostly waiting (a summary generation, a remote fetch): one slow
request must not hold up the others. The inbox is still read one message at a
time. `SideTasks` runs at most `limit` requests at once, each in its own task with
its own clone of the message's reply stream (the actor base closes the original
when `handle` returns), so every asker gets exactly one answer, or `ActorStopped`
when the actor stops first. When every slot is taken a caller either waits for one
(so a full inbox turns into `ActorBusy` for askers rather than unbounded tasks) or
is told at once that none is free (and refuses the request itself). A side task's
fault is handled as the inbox loop handles one (`Actor.fault`): its request fails,
the other tasks and the actor go on.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, ClassVar, Generic, TypeVar

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.runtime.actor import Actor
from courier.runtime.faults import BrokenInvariant
from courier.runtime.message import Message

M = TypeVar("M", bound=Message)
SideWork = Callable[[M, MemoryObjectSendStream[Any]], Awaitable[None]]
OnFault = Callable[[M, Exception, MemoryObjectSendStream[Any]], None]


class SideTasks(Generic[M]):
    def __init__(self, limit: int, on_fault: OnFault[M]) -> None:
        self._on_fault = on_fault
        self._slots = anyio.Semaphore(limit)
        self._group: TaskGroup | None = None
        self._ready = anyio.Event()

    async def run(self) -> None:
        """Hold the task group; run this as (part of) the actor's `background`, which is cancelled when it stops."""
        async with anyio.create_task_group() as group:
            self._group = group
            self._ready.set()
            await anyio.sleep_forever()

    async def start(self, message: M, work: SideWork[M], *, wait: bool) -> bool:
        """Run `work(message, reply)` in its own task, `reply` being a clone of the message's reply stream that is
        closed when the work ends. Without a free slot: wait for one (`wait`), or return False at once."""
        if wait:
            await self._slots.acquire()
        else:
            try:
                self._slots.acquire_nowait()
            except anyio.WouldBlock:
                return False
        try:
            await self._ready.wait()
            reply: MemoryObjectSendStream[Any] = message.reply.clone()  # type: ignore[attr-defined]
        except BaseException:
            self._slots.release()
            raise
        assert self._group is not None
        self._group.start_soon(self._run, message, reply, work)
        return True

    async def _run(self, message: M, reply: MemoryObjectSendStream[Any], work: SideWork[M]) -> None:
        with reply:
            try:
                await work(message, reply)
            except BrokenInvariant:
                raise
            except Exception as error:
                self._on_fault(message, error, reply)
            finally:
                self._slots.release()


class ConcurrentActor(Actor[M]):
    max_concurrent: ClassVar[int]

    def __init__(self) -> None:
        self._side_tasks: SideTasks[M] = SideTasks(self.max_concurrent, self.fault)

    async def background(self) -> None:
        await self._side_tasks.run()

    async def handle(self, message: M) -> None:
        await self._side_tasks.start(message, self._serve_and_reply, wait=True)

    async def _serve_and_reply(self, message: M, reply: MemoryObjectSendStream[Any]) -> None:
        result = await self.serve(message)
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await reply.send(result)

    @abstractmethod
    async def serve(self, message: M) -> Any:
        """The reply to `message` (a typed failure for a per-request failure; anything raised stops the actor)."""
