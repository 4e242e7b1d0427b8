"""SchedulerActor: owns the model's batch engine and runs continuous batching.

Receives `SubmitGeneration`; replies `GenerationQueued`, or `RequestFailed`
(OVERLOADED) when the running batch and the waiting queue are both full. Sends
each request's `GenerationEvent`s on the stream the request came with and closes
it after the terminal event. With prompt caching, asks the snapshot store for a
request's longest cached prefix before it joins the batch (`LookupPrefix`, in a
task of its own once the request could join next: the batch steps on while it is
out, and a request waits for its answer at most the lookup timeout) and tells it
the snapshots the engine takes (`InsertSnapshot`), a cancelled request's too (what it
had prefilled). A request whose prompt another request is still prefilling (the same
request sent again) looks up only once that one's state is in the store. Receives
`QueueWarmUp` (no reply): run when idle, it extends a conversation's snapshot
over the reply just given, and pauses as soon as live requests arrive (it keeps its
place and its progress, and resumes at the next idle moment).

Invariants: at most `max_batch` sequences run and at most `max_queue` wait; every
queued request ends with exactly one `GenerationFinished` or `GenerationFailed`
unless its consumer went away first (closing its event stream), in which case it
leaves the batch at the next step. All engine work happens on the MLX thread;
new requests join the running batch at the next step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from functools import partial

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.prompt_cache.store_link import (
    STORE_LOOKUP_TIMEOUT_S,
    WARM_UP_LOOKUP_TIMEOUT_S,
    PromptCaching,
    ask_store,
    cached_prefix,
    tell_store,
)
from courier.actors.queued_request import QueuedRequest
from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.entries import Bucket
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import (
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    RequestId,
    TokensGenerated,
)
from courier.engine.warm_up import WarmUp
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.scheduler import GenerationQueued, QueueWarmUp, SchedulerMessage, SubmitGeneration
from courier.messages.snapshot_store import LookupReply, PrefixMissed
from courier.runtime.actor import Actor
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import TraceCarrier, current_carrier
from courier.status.scheduler_stats import SchedulerStats

SHUTDOWN_MESSAGE = "the server is shutting down"
DEADLINE_MESSAGE = "the request reached its deadline (--request-timeout) before its first token"
logger = logging.getLogger(__name__)

# Warm-ups waiting for an idle moment, one per session, newest kept.
WARM_UP_QUEUE = 8
# An idle scheduler gathers a burst for at most this many admission windows.
_BURST_WINDOWS = 5
# A request waits for another's prefill (`_leader`) only when that covers at least this many tokens of its prompt.
_LEADER_MIN_TOKENS = 256


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
        self._clock = clock  # what requests' deadlines are read against (`time.monotonic` in the server)
        self._lookup_timeout_s = lookup_timeout_s
        self._mlx = mlx
        self._observe_ttft = observe_time_to_first_token
        self._caching = caching
        self._admission_window_s = admission_window_s
        self._make_engine = make_engine
        self._stats = stats
        self._waiting: deque[QueuedRequest] = deque()
        self._running: dict[RequestId, QueuedRequest] = {}
        self._cancelled: list[RequestId] = []
        # Cancelled requests until the step that took them out of the batch is delivered: it may carry the state one
        # had prefilled (`engine/cancelled_prefill.py`), which goes to the store under its session.
        self._leaving: dict[RequestId, QueuedRequest] = {}
        self._wake = anyio.Event()
        self._engine: BatchEngine | None = None
        self._warm_ups: OrderedDict[str, QueueWarmUp] = OrderedDict()
        # The warm-up live work interrupted, with what it had prefilled: resumed when it is next in line.
        self._paused: tuple[QueueWarmUp, WarmUp] | None = None
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
        self._fail_everything(SHUTDOWN_MESSAGE)

    async def handle(self, message: SchedulerMessage) -> None:
        match message:
            case SubmitGeneration():
                await self._on_submit_generation(message)
            case QueueWarmUp():
                self._on_queue_warm_up(message)

    def _on_queue_warm_up(self, message: QueueWarmUp) -> None:
        if self._caching is None:
            return
        self._stats.warmups_queued += 1
        if self._warm_ups.pop(message.session, None) is not None:
            self._stats.warmups_skipped += 1  # superseded by this newer one of the same conversation
        self._warm_ups[message.session] = message
        while len(self._warm_ups) > WARM_UP_QUEUE:
            self._warm_ups.popitem(last=False)
            self._stats.warmups_skipped += 1
        if self._paused is not None and self._warm_ups.get(self._paused[0].session) is not self._paused[0]:
            self._paused = None  # its warm-up was superseded or dropped: let go of its state
        self._stats.warmups_pending = len(self._warm_ups)
        self._wake.set()

    async def _on_submit_generation(self, message: SubmitGeneration) -> None:
        stats = self._stats
        if self._sequences() + message.n > stats.max_batch + stats.max_queue:
            stats.rejected += 1
            message.events.close()
            full = f"the server is at capacity ({stats.max_batch} running, {stats.max_queue} waiting); retry shortly"
            await message.reply.send(
                RequestFailed(kind=FailureKind.OVERLOADED, message=full, code=FailureCode.QUEUE_FULL)
            )
            return
        caching = self._caching is not None and message.cache_prompt
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
            bucket=self._bucket(message.vision.digest if message.vision is not None else "", message.tenant),
            deadline=message.deadline,
        )
        self._waiting.append(queued)
        self._update_counts()
        self._start_lookups()  # while the current step runs
        self._wake.set()
        await message.reply.send(GenerationQueued(request_id=message.request_id, queue_position=len(self._waiting)))

    async def _drive(self, engine: BatchEngine) -> None:
        while True:
            if not self._running and not self._waiting and not self._cancelled:
                if self._warm_ups:
                    warm_up = self._next_warm_up()
                    try:
                        await self._warm_up(engine, warm_up)
                    finally:
                        self._stats.warmups_pending = len(self._warm_ups)
                    continue
                self._wake = anyio.Event()
                await self._wake.wait()
                if self._waiting:  # (not a warm-up or a cancellation, which run at once)
                    await self._gather_burst(engine)
                continue
            self._drop_abandoned()
            expired = self._expire()
            self._start_lookups()
            added = self._promote()
            if not added and not self._running and not self._cancelled:
                if self._waiting:
                    self._wake = anyio.Event()  # only requests whose lookups are out: wait for an answer
                    await self._wake.wait()
                continue  # (none left: their consumers went away) back to idle, and its warm-ups
            cancelled, self._cancelled = self._cancelled, []
            outputs = await self._mlx.call(partial(engine.step, added, cancelled, expired))
            self._count_steps(engine)
            self._deliver(outputs)
            for request_id in cancelled:
                self._leaving.pop(request_id, None)

    def _count_steps(self, engine: BatchEngine) -> None:
        counters, stats = engine.speculation, self._stats.speculation
        stats.steps, stats.verify_steps, stats.tokens = counters.steps, counters.verify_steps, counters.tokens
        stats.drafted, stats.accepted, stats.forced = counters.drafted, counters.accepted, counters.forced

    async def _gather_burst(self, engine: BatchEngine) -> None:
        """Let a burst of arrivals gather so it is prefilled as one batch; only an idle engine waits, and only for a
        step longer than a window.

        The wait lasts while requests keep arriving at most one window apart (a burst of clients sent
        by one process takes longer than one window to arrive), up to `_BURST_WINDOWS` windows in all,
        and ends early once a full batch waits. A lone request waits one window, unless the step that would admit
        what waits is estimated at no more than a window (`_short_step_ahead`).
        """
        window = self._admission_window_s
        if window <= 0:
            return
        deadline = time.monotonic() + window * _BURST_WINDOWS
        if await self._short_step_ahead(engine, window):
            self._stats.admission_windows_skipped += 1
            return
        self._stats.admission_windows_waited += 1
        while True:
            seen = len(self._waiting)
            await anyio.sleep(window)
            arrived = len(self._waiting) > seen
            if not arrived or len(self._waiting) >= self._stats.max_batch or time.monotonic() >= deadline:
                return

    async def _short_step_ahead(self, engine: BatchEngine, window: float) -> bool:
        """Whether the step admitting the waiting requests would take at most `window`, by the engine's cost model,
        once their lookups have answered (waited for at most a window). A burst that comes during so short a step
        joins at the next one, sooner than a window's wait would have admitted it: an agent's turn, most of its
        prompt cached, is admitted at once instead of waiting the window out."""
        with anyio.move_on_after(window):
            while any(not queued.looked_up for queued in self._waiting):
                self._wake = anyio.Event()
                await self._wake.wait()
        if not self._waiting or any(not queued.looked_up for queued in self._waiting):
            return False
        prompts = []
        for queued in self._waiting:
            depth = queued.prefix.matched if queued.prefix is not None else 0
            prompts.append((depth, len(queued.request.prompt_tokens) - depth))
        return await self._mlx.call(partial(engine.admission_seconds, prompts)) <= window

    def _start_lookups(self) -> None:
        """Ask the store for the prefixes of the waiting requests that fit in the batch's free slots (in order), each
        in its own task: a lookup that takes long holds up only its own request."""
        if self._lookups is None:
            return  # the drive loop has not started: it starts them
        free = self._stats.max_batch - self._running_sequences()
        for queued in self._waiting:
            free -= queued.width
            if free < 0:
                return
            if queued.lookup_started or self._leader(queued) is not None:
                continue  # (looked up when what its leader prefills is in the store)
            queued.lookup_started = True
            if not queued.cache_prompt:
                queued.looked_up = True
                continue
            self._lookups.start_soon(self._look_up, queued)

    async def _look_up(self, queued: QueuedRequest) -> None:
        try:
            found = await self._ask_store(queued.session, queued.request.prompt_tokens, queued.trace, queued.bucket)
            queued.prefix = cached_prefix(found)
        except Exception:  # a lookup's trouble is a miss for its request, never the scheduler's end
            logger.exception("prompt cache: a prefix lookup failed; the request runs without a cached prefix")
        finally:
            queued.looked_up = True
            self._wake.set()

    def _promote(self) -> list[EngineRequest]:
        """Waiting requests join the batch in order while their samples fit (the first that does not fit waits, and
        so do those behind it). One whose lookup is still out keeps its place while those behind it that are ready
        go ahead: a slow lookup holds up its own request only, and the batch steps on meanwhile."""
        added: list[EngineRequest] = []
        for queued in list(self._waiting):
            if self._running_sequences() + queued.width > self._stats.max_batch:
                break
            if not queued.looked_up:
                continue
            if self._leader(queued) is not None:  # it came while its lookup was out: look up again after the leader
                queued.lookup_started = queued.looked_up = False
                queued.prefix = None
                continue
            self._waiting.remove(queued)
            self._running[queued.request.request_id] = queued
            request = queued.request
            added.append(replace(request, prefix=queued.prefix) if queued.prefix is not None else request)
            queued.prefix = None  # the engine holds it now
        self._update_counts()
        return added

    def _leader(self, queued: QueuedRequest) -> QueuedRequest | None:
        """A running (or just cancelled) request still prefilling all of `queued`'s prompt but its last token, for the
        store (the same request sent again, by a client that gave up on the first or not): `queued` waits for it and
        then looks up what it left there, rather than prefilling the same tokens beside it or from zero."""
        if not queued.cache_prompt:
            return None
        prompt = queued.request.prompt_tokens
        for leader in (*self._running.values(), *self._leaving.values()):
            if leader.prefilling and leader.cache_prompt and leader.bucket == queued.bucket and leader.width == 1:
                covered = leader.request.prompt_tokens[:-1]
                if len(covered) >= _LEADER_MIN_TOKENS and prompt[: len(covered)] == covered:
                    return leader
        return None

    def _bucket(self, media_digest: str, tenant: str) -> Bucket | None:
        return self._caching.bucket_for(media_digest, tenant) if self._caching else None

    async def _ask_store(
        self,
        session: str,
        tokens: tuple[int, ...],
        trace: TraceCarrier,
        bucket: Bucket | None,
        *,
        check_extended: bool = False,
        timeout_s: float | None = None,
    ) -> LookupReply | None:
        """The store's answer, or None (a miss) without caching, or when the store is busy, stopped, or silent past
        `timeout_s` (default: the lookup timeout)."""
        if self._caching is None or bucket is None:
            return None
        timeout_s = self._lookup_timeout_s if timeout_s is None else timeout_s
        return await ask_store(
            self._caching,
            self._stats,
            session=session,
            tokens=tokens,
            trace=trace,
            bucket=bucket,
            timeout_s=timeout_s,
            check_extended=check_extended,
        )

    async def _warm_up(self, engine: BatchEngine, message: QueueWarmUp) -> None:
        """Extend the session's snapshot over `message.tokens`, yielding to live requests between chunks."""
        tokens = message.tokens
        bucket = self._bucket("", message.tenant)
        paused, self._paused = self._paused, None  # `_next_warm_up` handed out the paused one first
        found = await self._ask_store(
            message.session,
            tokens,
            message.trace,
            bucket,
            check_extended=True,
            timeout_s=min(self._lookup_timeout_s, WARM_UP_LOOKUP_TIMEOUT_S),
        )
        prefix = cached_prefix(found)
        already = isinstance(found, PrefixMissed) and found.extended
        # A store that did not answer (busy, or late under load) is no reason to prefill the whole history cold:
        # that adds the load that made it late. The next turn starts from what the store holds.
        if found is None or already or (prefix is not None and prefix.matched >= len(tokens) - 1):
            self._stats.warmups_skipped += 1  # the conversation has moved on, or this is covered already
            return
        if paused is not None and paused[0] is message:
            job = paused[1]  # resumed where live work interrupted it
        else:
            job = await self._mlx.call(partial(WarmUp, engine.model, tokens, prefix, engine.snapshot_quantization))
        while not job.finished:
            if self._running or self._waiting:
                self._pause(message, job)  # live work first, always; this one keeps its place
                return
            await self._mlx.call(job.advance)
        snapshot = await self._mlx.call(job.snapshot)
        self._insert(message.session, snapshot, message.trace, bucket)
        self._stats.warmups_run += 1

    def _next_warm_up(self) -> QueueWarmUp:
        """The paused warm-up first (it was next when live work came, and keeps what it prefilled), else the newest."""
        if self._paused is not None:
            return self._warm_ups.pop(self._paused[0].session)
        return self._warm_ups.popitem(last=True)[1]

    def _pause(self, message: QueueWarmUp, job: WarmUp) -> None:
        """Live work arrived: the warm-up goes back in line as the next one (unless a newer warm-up of its conversation
        came meanwhile), keeping what it prefilled. Dropped, the conversation's next turn would prefill its reply."""
        if message.session in self._warm_ups:
            self._stats.warmups_skipped += 1  # superseded by the newer one
            return
        self._stats.warmups_paused += 1
        self._warm_ups[message.session] = message
        self._paused = (message, job)
        while len(self._warm_ups) > WARM_UP_QUEUE:
            self._warm_ups.popitem(last=False)
            self._stats.warmups_skipped += 1
        self._stats.warmups_pending = len(self._warm_ups)

    def _drop_abandoned(self) -> None:
        """Consumers that closed their end: queued ones are dropped, running ones leave the batch."""
        for queued in [q for q in self._waiting if _abandoned(q.events)]:
            self._waiting.remove(queued)
            queued.events.close()
            self._stats.cancelled += 1
        for request_id in [r for r, queued in self._running.items() if _abandoned(queued.events)]:
            self._end(request_id, cancelled=True)

    def _expire(self) -> list[RequestId]:
        """Requests past their deadline. A waiting one fails (504: it never started); running ones are returned for
        the engine, which ends each as a length cut with what it wrote (or fails it, if it wrote nothing)."""
        now = self._clock()
        for queued in [q for q in self._waiting if q.past_deadline(now)]:
            self._waiting.remove(queued)
            late = GenerationFailed(message=DEADLINE_MESSAGE, code=FailureCode.DEADLINE_EXCEEDED)
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                queued.events.send_nowait(late)
            queued.events.close()
            self._stats.timed_out += 1
        self._update_counts()
        expired = [r for r, queued in self._running.items() if not queued.expired and queued.past_deadline(now)]
        for request_id in expired:
            self._running[request_id].expired = True
        return expired

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            running = self._running.get(output.request_id)
            if isinstance(output.event, SnapshotTaken):
                owner = running if running is not None else self._leaving.get(output.request_id)
                if owner is not None:
                    self._keep_snapshot(owner, output.event)
                continue
            if running is None:
                continue
            running.prefilling = False
            events = running.events
            if isinstance(output.event, TokensGenerated):
                self._stats.generated_tokens += len(output.event.token_ids)
                if not running.first_token_seen and self._observe_ttft is not None:
                    running.first_token_seen = True
                    self._observe_ttft(time.monotonic() - running.queued_at)
            try:
                events.send_nowait(output.event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                self._end(output.request_id, cancelled=True)
                continue
            if isinstance(output.event, GenerationFinished):
                running.finished += 1
                running.tally.add(output.event)
                if running.finished == running.width:
                    running.tally.record(running.trace, output.event)
                    self._stats.completed += 1
                    self._stats.cut_at_deadline += output.event.deadline
                    self._end(output.request_id)
            elif isinstance(output.event, GenerationFailed):
                if output.event.code is FailureCode.DEADLINE_EXCEEDED:
                    self._stats.timed_out += 1
                else:
                    self._stats.failed += 1
                # One sample failing fails the request: the others leave the batch (as a cancellation would).
                self._end(output.request_id, cancelled=running.finished + 1 < running.width, counted=False)

    def _keep_snapshot(self, running: QueuedRequest, snapshot: SnapshotTaken) -> None:
        if running.cache_prompt:  # a request that opted out of the prompt cache leaves nothing in it
            self._insert(running.session, snapshot, running.trace, running.bucket)

    def _insert(self, session: str, snapshot: SnapshotTaken, trace: TraceCarrier, bucket: Bucket | None) -> None:
        if self._caching is not None and bucket is not None:
            tell_store(self._caching, self._stats, session=session, snapshot=snapshot, trace=trace, bucket=bucket)

    def _end(self, request_id: RequestId, *, cancelled: bool = False, counted: bool = True) -> None:
        """`cancelled`: its sequences still in the batch leave it (`counted`: as a cancellation in the stats)."""
        running = self._running.pop(request_id, None)
        if running is not None:
            running.events.close()
        if cancelled:
            if counted:
                self._stats.cancelled += 1
            self._cancelled.append(request_id)
            if running is not None:
                self._leaving[request_id] = running
        self._update_counts()

    def _fail_everything(self, message: str) -> None:
        failure = GenerationFailed(message=message, code=FailureCode.SHUTTING_DOWN)
        streams = [q.events for q in self._waiting] + [q.events for q in self._running.values()]
        self._waiting.clear()
        self._running.clear()
        self._leaving.clear()
        for events in streams:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                events.send_nowait(failure)
            events.close()
            self._stats.failed += 1
        self._update_counts()

    def _update_counts(self) -> None:
        self._stats.running = self._running_sequences()
        self._stats.waiting = sum(queued.width for queued in self._waiting)

    def _running_sequences(self) -> int:
        return sum(queued.width for queued in self._running.values())

    def _sequences(self) -> int:
        """Running and waiting, counted in sequences (a request of `n` samples is `n`)."""
        return self._running_sequences() + sum(queued.width for queued in self._waiting)


def _abandoned(events: MemoryObjectSendStream[GenerationEvent]) -> bool:
    return events.statistics().open_receive_streams == 0
