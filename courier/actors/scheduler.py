"""SchedulerActor: owns the model's batch engine and runs continuous batching.

Receives `SubmitGeneration`; replies `GenerationQueued`, or `RequestFailed` (OVERLOADED) when the running batch and
the waiting queue are both full. Sends each request's `GenerationEvent`s on the stream the request came with and
closes it after the terminal event (`scheduling/delivery.py`). With prompt caching, asks the snapshot store for a
request's longest cached prefix before it joins the batch (`LookupPrefix`, in a task of its own once the request
could join next: `scheduling/promotion.py`) and tells it the snapshots the engine takes (`InsertSnapshot`), a
cancelled request's too (what it had prefilled). Receives `QueueWarmUp` (no reply): run when idle, it extends a
conversation's snapshot over the reply just given, and pauses as soon as live requests arrive
(`scheduling/warm_ups.py`).

The actor keeps the drive loop: idle, it runs warm-ups or waits for a request (and an admission window); busy, it
drops abandoned requests, expires those past their deadline, promotes waiting ones and steps the engine on the MLX
thread, then delivers the step's outputs.

Invariants: at most `max_batch` sequences run and at most `max_queue` wait; every queued request ends with exactly
one `GenerationFinished` or `GenerationFailed` unless its consumer went away first (closing its event stream), in
which case it leaves the batch at the next step. All engine work happens on the MLX thread; new requests join the
running batch at the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import anyio
from anyio.abc import TaskGroup

from courier.actors.prompt_cache.store_link import STORE_LOOKUP_TIMEOUT_S, PromptCaching, StoreLink
from courier.actors.scheduling.delivery import Delivery
from courier.actors.scheduling.held_requests import HeldRequests
from courier.actors.scheduling.promotion import Promotion
from courier.actors.scheduling.queued_request import QueuedRequest
from courier.actors.scheduling.wakeup import Wakeup
from courier.actors.scheduling.warm_ups import WarmUps
from courier.core.failure_codes import FailureCode
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineRequest
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.scheduler import GenerationQueued, QueueWarmUp, SchedulerMessage, SubmitGeneration
from courier.runtime.actor import Actor
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import current_carrier
from courier.status.scheduler_stats import SchedulerStats

SHUTDOWN_MESSAGE = "the server is shutting down"


class SchedulerActor(Actor[SchedulerMessage]):
    name = "scheduler"

    def __init__(
        self,
        mlx: MlxThread,
        make_engine: Callable[[], BatchEngine],
        stats: SchedulerStats,
        *,
        admission_window_s: float = 0.0,
        caching: PromptCaching | None = None,
        observe_time_to_first_token: Callable[[float], None] | None = None,
        lookup_timeout_s: float = STORE_LOOKUP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mlx = mlx
        self._make_engine = make_engine
        self._stats = stats
        self._store = StoreLink(caching, stats, lookup_timeout_s=lookup_timeout_s)
        self._held = HeldRequests(stats)
        self._wake = Wakeup()
        self._promotion = Promotion(self._held, self._store, stats, self._wake, admission_window_s=admission_window_s)
        self._delivery = Delivery(
            self._held, self._store, stats, observe_time_to_first_token=observe_time_to_first_token, clock=clock
        )
        self._warm_ups = WarmUps(self._store, stats, mlx)
        self._engine: BatchEngine | None = None
        self._lookups: TaskGroup | None = None

    async def setup(self) -> None:
        self._engine = await self._mlx.call(self._make_engine)
        self._stats.speculation.mode = self._engine.speculation_mode
        if (kv := self._engine.kv_quantization) is not None:
            self._stats.kv_bits, self._stats.kv_group_size = kv.bits, kv.group_size

    async def background(self) -> None:
        assert self._engine is not None, "setup() builds the engine"
        async with anyio.create_task_group() as lookups:
            self._lookups = lookups
            await self._drive(self._engine)

    def stopped(self) -> None:
        self._delivery.fail_everything(SHUTDOWN_MESSAGE)

    async def handle(self, message: SchedulerMessage) -> None:
        match message:
            case SubmitGeneration():
                await self._on_submit_generation(message)
            case QueueWarmUp():
                self._on_queue_warm_up(message)

    def _on_queue_warm_up(self, message: QueueWarmUp) -> None:
        if self._warm_ups.queue(message):
            self._wake.set()

    async def _on_submit_generation(self, message: SubmitGeneration) -> None:
        stats, held = self._stats, self._held
        if held.running_sequences() + held.waiting_sequences() + message.n > stats.max_batch + stats.max_queue:
            stats.rejected += 1
            message.events.close()
            full = f"the server is at capacity ({stats.max_batch} running, {stats.max_queue} waiting); retry shortly"
            await message.reply.send(
                RequestFailed(kind=FailureKind.OVERLOADED, message=full, code=FailureCode.QUEUE_FULL)
            )
            return
        caching = self._store.enabled and message.cache_prompt
        request = EngineRequest(
            request_id=message.request_id,
            prompt_tokens=message.prompt_tokens,
            sampling=message.sampling,
            boundary=message.boundary if caching else 0,
            snapshots=caching,
            vision=message.vision,
            n=message.n,
            tenant=message.tenant,
        )
        queued = QueuedRequest(
            request=request,
            events=message.events,
            session=message.session,
            cache_prompt=caching,
            queued_at=time.monotonic(),
            trace=current_carrier(),
            bucket=self._store.bucket(message.vision.digest if message.vision is not None else "", message.tenant),
            deadline=message.deadline,
        )
        held.waiting.append(queued)
        held.update_counts()
        self._start_lookups()  # while the current step runs
        self._wake.set()
        await message.reply.send(GenerationQueued(request_id=message.request_id, queue_position=len(held.waiting)))

    async def _drive(self, engine: BatchEngine) -> None:
        held = self._held
        while True:
            if held.idle():
                if self._warm_ups:
                    await self._warm_ups.run_next(engine, held.live)
                    continue
                await self._wake.wait()
                if held.waiting:  # (not a warm-up or a cancellation, which run at once)
                    await self._promotion.gather_burst(engine)
                continue
            self._delivery.drop_abandoned()
            expired = self._delivery.expire()
            self._start_lookups()
            added = self._promotion.promote()
            if not added and not held.running and not held.cancelled:
                if held.waiting:
                    await self._wake.wait()  # only requests whose lookups are out: wait for an answer
                continue  # (none left: their consumers went away) back to idle, and its warm-ups
            cancelled = held.take_cancelled()
            outputs = await self._mlx.call(partial(engine.step, added, cancelled, expired))
            self._count_steps(engine)
            self._delivery.deliver(outputs)
            held.left(cancelled)

    def _start_lookups(self) -> None:
        if self._lookups is not None:  # (before the drive loop starts, it starts them)
            self._promotion.start_lookups(self._lookups)

    def _count_steps(self, engine: BatchEngine) -> None:
        counters, stats = engine.speculation, self._stats.speculation
        stats.steps, stats.verify_steps, stats.tokens = counters.steps, counters.verify_steps, counters.tokens
        stats.drafted, stats.accepted, stats.forced = counters.drafted, counters.accepted, counters.forced
