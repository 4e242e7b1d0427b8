"""SchedulerActor: owns the model's batch engine and runs continuous batching.

Receives `SubmitGeneration`; replies `GenerationQueued`, or `RequestFailed`
(OVERLOADED) when the running batch and the waiting queue are both full. Sends
each request's `GenerationEvent`s on the stream the request came with and closes
it after the terminal event.

Invariants: at most `max_batch` sequences run and at most `max_queue` wait; every
queued request ends with exactly one `GenerationFinished` or `GenerationFailed`
unless its consumer went away first (closing its event stream), in which case it
leaves the batch at the next step. All engine work happens on the MLX thread;
new requests join the running batch at the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from courier.core.batch_engine import BatchEngine, EngineOutput, EngineRequest
from courier.messages.base import FailureKind, RequestFailed, RequestId
from courier.messages.generation import GenerationEvent, GenerationFailed, GenerationFinished, TokensGenerated
from courier.messages.scheduler import GenerationQueued, SchedulerMessage, SubmitGeneration
from courier.runtime.actor import Actor
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.scheduler_stats import SchedulerStats

SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclass(slots=True, kw_only=True)
class _Queued:
    request: EngineRequest
    events: MemoryObjectSendStream[GenerationEvent]


class SchedulerActor(Actor[SchedulerMessage]):
    name = "scheduler"

    def __init__(
        self,
        mlx: MlxThread,
        make_engine: Callable[[], BatchEngine],
        stats: SchedulerStats,
        *,
        admission_window_s: float = 0.0,
    ) -> None:
        self._mlx = mlx
        self._admission_window_s = admission_window_s
        self._make_engine = make_engine
        self._stats = stats
        self._waiting: deque[_Queued] = deque()
        self._running: dict[RequestId, MemoryObjectSendStream[GenerationEvent]] = {}
        self._cancelled: list[RequestId] = []
        self._wake = anyio.Event()
        self._engine: BatchEngine | None = None

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerMessage],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        self._engine = await self._mlx.call(self._make_engine)
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._drive, self._engine)
            try:
                await super().run(inbox, task_status=task_status)
            finally:
                task_group.cancel_scope.cancel()
                self._fail_everything(SHUTDOWN_MESSAGE)

    async def handle(self, message: SchedulerMessage) -> None:
        match message:
            case SubmitGeneration():
                await self._on_submit_generation(message)

    async def _on_submit_generation(self, message: SubmitGeneration) -> None:
        stats = self._stats
        if len(self._running) + len(self._waiting) >= stats.max_batch + stats.max_queue:
            stats.rejected += 1
            message.events.close()
            full = f"the server is at capacity ({stats.max_batch} running, {stats.max_queue} waiting); retry shortly"
            await message.reply.send(RequestFailed(kind=FailureKind.OVERLOADED, message=full, code="queue_full"))
            return
        request = EngineRequest(
            request_id=message.request_id, prompt_tokens=message.prompt_tokens, sampling=message.sampling
        )
        self._waiting.append(_Queued(request=request, events=message.events))
        self._update_counts()
        self._wake.set()
        await message.reply.send(GenerationQueued(request_id=message.request_id, queue_position=len(self._waiting)))

    async def _drive(self, engine: BatchEngine) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake = anyio.Event()
                await self._wake.wait()
                # Requests that arrive together (a burst of clients) get one batched prefill instead of a lone
                # first prefill that delays all the others; only an idle engine waits, never a running batch.
                await anyio.sleep(self._admission_window_s)
                continue
            self._drop_abandoned()
            added = self._promote()
            cancelled, self._cancelled = self._cancelled, []
            outputs = await self._mlx.call(partial(engine.step, added, cancelled))
            self._deliver(outputs)

    def _promote(self) -> list[EngineRequest]:
        added: list[EngineRequest] = []
        while self._waiting and len(self._running) < self._stats.max_batch:
            queued = self._waiting.popleft()
            self._running[queued.request.request_id] = queued.events
            added.append(queued.request)
        self._update_counts()
        return added

    def _drop_abandoned(self) -> None:
        """Consumers that closed their end: queued ones are dropped, running ones leave the batch."""
        for queued in [q for q in self._waiting if _abandoned(q.events)]:
            self._waiting.remove(queued)
            queued.events.close()
            self._stats.cancelled += 1
        for request_id in [r for r, events in self._running.items() if _abandoned(events)]:
            self._end(request_id, cancelled=True)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            events = self._running.get(output.request_id)
            if events is None:
                continue
            if isinstance(output.event, TokensGenerated):
                self._stats.generated_tokens += len(output.event.token_ids)
            try:
                events.send_nowait(output.event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                self._end(output.request_id, cancelled=True)
                continue
            if isinstance(output.event, GenerationFinished):
                self._stats.completed += 1
                self._end(output.request_id)
            elif isinstance(output.event, GenerationFailed):
                self._stats.failed += 1
                self._end(output.request_id)

    def _end(self, request_id: RequestId, *, cancelled: bool = False) -> None:
        events = self._running.pop(request_id, None)
        if events is not None:
            events.close()
        if cancelled:
            self._stats.cancelled += 1
            self._cancelled.append(request_id)
        self._update_counts()

    def _fail_everything(self, message: str) -> None:
        failure = GenerationFailed(message=message)
        streams = [q.events for q in self._waiting] + list(self._running.values())
        self._waiting.clear()
        self._running.clear()
        for events in streams:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                events.send_nowait(failure)
            events.close()
            self._stats.failed += 1
        self._update_counts()

    def _update_counts(self) -> None:
        self._stats.running = len(self._running)
        self._stats.waiting = len(self._waiting)


def _abandoned(events: MemoryObjectSendStream[GenerationEvent]) -> bool:
    return events.statistics().open_receive_streams == 0
