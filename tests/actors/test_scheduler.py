"""SchedulerActor over real anyio streams and a real MLX thread, with a scripted fake engine and a fake store.

The fake engine stands in for `BatchEngine` on the MLX thread: each `step` records what it was given (the
requests added, the ids cancelled) and answers with the next outputs the test scripted; with none scripted it
waits there, like a long forward pass, so a request stays running until the test lets it go. A `FakeNeighbour`
stands in for the snapshot store. The tests assert what the scheduler sends: its replies, each request's
events, the store's messages and the engine's steps, in order. Nothing sleeps: the tests wait on events.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any, cast

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.actors.prompt_cache.store_link import STORE_LOOKUP_TIMEOUT_S, PromptCaching
from courier.actors.scheduler import SHUTDOWN_MESSAGE, SchedulerActor
from courier.actors.scheduling.delivery import DEADLINE_MESSAGE
from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.entries import Bucket, Origin
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
    VisionInputs,
)
from courier.engine.model_state import CachedPrefix
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.scheduler import (
    GenerationQueued,
    QueueWarmUp,
    SchedulerMessage,
    SubmitGeneration,
    SubmitReply,
)
from courier.messages.snapshot_store import (
    InsertSnapshot,
    LookupPrefix,
    LookupReply,
    PrefixFound,
    PrefixMissed,
    SnapshotStoreMessage,
)
from courier.runtime.actor import ActorStopped, ask
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import tracer
from courier.status.scheduler_stats import SchedulerStats
from tests.support.actors import FakeNeighbour, busy_inbox, run_actor, start_neighbours, stopped_inbox
from tests.support.fake_engine import FakeEngine, Step

Inbox = MemoryObjectSendStream[SchedulerMessage]
Store = FakeNeighbour[SnapshotStoreMessage]
EventsSend = MemoryObjectSendStream[GenerationEvent]
EventsReceive = MemoryObjectReceiveStream[GenerationEvent]

# A hung scheduler fails its test in seconds instead of at the suite's timeout.
TIMEOUT_S = 10.0
BUCKET = Bucket(model_id="tiny-model")
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = (11, 12, 13, 14)
BOUNDARY = 3  # the conversation's history is the prompt's first three tokens
HISTORY_FOUND = PrefixFound(state="history-state", length=3, matched=3, trimmed=False, continues=41)


class FakeClock:
    """The time the scheduler reads deadlines against, moved by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def running_scheduler(
    engine: FakeEngine,
    stats: SchedulerStats,
    store: MemoryObjectSendStream[SnapshotStoreMessage] | None = None,
    clock: FakeClock | None = None,
    lookup_timeout_s: float = STORE_LOOKUP_TIMEOUT_S,
) -> AsyncIterator[Inbox]:
    """The scheduler on a real MLX thread, caching into `store` when given; leaving stops it like the server does."""
    caching = PromptCaching(store=store, bucket=BUCKET) if store is not None else None
    mlx = MlxThread()
    actor = SchedulerActor(
        mlx,
        lambda: cast(BatchEngine, engine),
        stats,
        caching=caching,
        clock=clock or FakeClock(),
        lookup_timeout_s=lookup_timeout_s,
    )
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with run_actor(actor) as inbox:
                yield inbox
    finally:
        engine.close()
        mlx.close(timeout=TIMEOUT_S)


@asynccontextmanager
async def store_neighbour(answer: Callable[[SnapshotStoreMessage], Any]) -> AsyncIterator[Store]:
    """A fake snapshot store answering with `answer`; it stops when the block ends (after the scheduler)."""
    store: Store = FakeNeighbour(answer)
    async with anyio.create_task_group() as tasks:
        await start_neighbours(tasks, store)
        with store.send:
            yield store


@asynccontextmanager
async def caching_scheduler(
    engine: FakeEngine, stats: SchedulerStats, answer: Callable[[SnapshotStoreMessage], Any]
) -> AsyncIterator[tuple[Store, Inbox]]:
    """The scheduler caching into a fake store; leaving stops the scheduler, then the store once it has read all."""
    async with store_neighbour(answer) as store, running_scheduler(engine, stats, store.send) as inbox:
        yield store, inbox


def lookups_answered(reply: LookupReply) -> Callable[[SnapshotStoreMessage], LookupReply | None]:
    return lambda message: reply if isinstance(message, LookupPrefix) else None


@contextmanager
def stopped_store() -> Iterator[MemoryObjectSendStream[Any]]:
    with stopped_inbox() as send:
        yield send


def event_stream() -> tuple[EventsSend, EventsReceive]:
    return anyio.create_memory_object_stream[GenerationEvent](16)


async def submit(
    inbox: Inbox,
    request_id: str,
    events: EventsSend,
    *,
    cache_prompt: bool = False,
    vision: VisionInputs | None = None,
    n: int = 1,
    deadline: float | None = None,
) -> SubmitReply:
    return await ask(
        inbox,
        lambda reply: SubmitGeneration(
            request_id=RequestId(request_id),
            prompt_tokens=PROMPT,
            sampling=SAMPLING,
            events=events,
            session="s1",
            boundary=BOUNDARY,
            cache_prompt=cache_prompt,
            vision=vision,
            reply=reply,
            n=n,
            deadline=deadline,
        ),
    )


async def read_all(events: EventsReceive) -> list[GenerationEvent]:
    """Every event until the scheduler closes the stream."""
    with events:
        return [event async for event in events]


def engine_request(request_id: str, **fields: Any) -> EngineRequest:
    return EngineRequest(request_id=RequestId(request_id), prompt_tokens=PROMPT, sampling=SAMPLING, **fields)


def added_ids(engine: FakeEngine) -> list[list[str]]:
    return [[request.request_id for request in step.added] for step in engine.steps]


def out(request_id: str, event: GenerationEvent | SnapshotTaken) -> EngineOutput:
    return EngineOutput(RequestId(request_id), event)


def text(value: str, *token_ids: int) -> TokensGenerated:
    return TokensGenerated(text=value, token_ids=token_ids)


def finished(completion_tokens: int, cached_tokens: int = 0) -> GenerationFinished:
    return GenerationFinished(
        reason=FinishReason.STOP,
        prompt_tokens=len(PROMPT),
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
    )


def boundary_snapshot() -> SnapshotTaken:
    return SnapshotTaken(origin=Origin.BOUNDARY, tokens=PROMPT[:BOUNDARY], state="boundary-state", nbytes=300)


def completion_snapshot(*generated: int) -> SnapshotTaken:
    return SnapshotTaken(
        origin=Origin.COMPLETION,
        tokens=PROMPT + generated,
        state="completion-state",
        nbytes=600,
        continues=41,
        prompt_length=len(PROMPT),
    )


SHUTDOWN = GenerationFailed(message=SHUTDOWN_MESSAGE, code=FailureCode.SHUTTING_DOWN)


@pytest.mark.anyio
async def test_a_request_streams_the_engines_events_then_one_finish() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", text("Hel", 7, 8)))
    async with running_scheduler(engine, stats) as inbox:
        send, receive = event_stream()
        assert await submit(inbox, "r1", send) == GenerationQueued(request_id=RequestId("r1"), queue_position=1)
        assert await receive.receive() == text("Hel", 7, 8)
        await engine.wait_for_steps(2)  # the second step waits for its script: the request is running
        assert (stats.running, stats.waiting, stats.generated_tokens) == (1, 0, 2)
        engine.then(out("r1", text("lo", 9)), out("r1", finished(3)))
        assert await read_all(receive) == [text("lo", 9), finished(3)]
    assert engine.steps == [Step((engine_request("r1"),), ()), Step((), ())]
    assert (stats.completed, stats.generated_tokens, stats.running, stats.waiting) == (1, 3, 0, 0)
    assert (stats.failed, stats.cancelled, stats.rejected) == (0, 0, 0)


@pytest.mark.anyio
async def test_a_request_that_does_not_cache_its_prompt_never_asks_the_store() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    # Even a snapshot the engine hands back for it is not kept: the request opted out of the prompt cache.
    engine.then(out("r1", completion_snapshot(7)), out("r1", finished(1)))
    async with caching_scheduler(engine, stats, lookups_answered(HISTORY_FOUND)) as (store, inbox):
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send, cache_prompt=False), GenerationQueued)
        assert await read_all(receive) == [finished(1)]
    assert store.received == []  # the store has read everything sent to it: no lookup, no insert
    assert engine.steps[0].added == (engine_request("r1", boundary=0, snapshots=False),)


@pytest.mark.anyio
async def test_the_store_is_asked_for_a_prefix_before_the_engine_sees_the_request() -> None:
    release = anyio.Event()

    async def found_when_released(message: SnapshotStoreMessage) -> LookupReply | None:
        if not isinstance(message, LookupPrefix):
            return None
        await release.wait()
        return HISTORY_FOUND

    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", finished(1, cached_tokens=3)))
    async with caching_scheduler(engine, stats, found_when_released) as (store, inbox):
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send, cache_prompt=True), GenerationQueued)
        await store.wait_for(1)
        assert engine.steps == []  # the lookup is not answered yet: the engine has seen nothing
        lookup = store.received[0]
        assert isinstance(lookup, LookupPrefix)
        assert (lookup.bucket, lookup.session, lookup.tokens, lookup.check_extended) == (BUCKET, "s1", PROMPT, False)
        release.set()
        assert await read_all(receive) == [finished(1, cached_tokens=3)]
    prefix = CachedPrefix(state="history-state", length=3, matched=3, continues=41)
    expected = engine_request("r1", prefix=prefix, boundary=BOUNDARY, snapshots=True)
    assert engine.steps == [Step((expected,), ())]


@pytest.mark.anyio
async def test_the_snapshots_the_engine_takes_go_to_the_store_after_the_lookup() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", boundary_snapshot()), out("r1", text("Hi", 7)))
    engine.then(out("r1", text("!", 8)), out("r1", completion_snapshot(7, 8)), out("r1", finished(2)))
    async with caching_scheduler(engine, stats, lookups_answered(PrefixMissed())) as (store, inbox):
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send, cache_prompt=True), GenerationQueued)
        assert await read_all(receive) == [text("Hi", 7), text("!", 8), finished(2)]  # no snapshot leaks out
    assert store.kinds == ["LookupPrefix", "InsertSnapshot", "InsertSnapshot"]
    inserts = [m for m in store.received if isinstance(m, InsertSnapshot)]
    assert [(m.bucket, m.session, m.origin, m.tokens, m.state, m.nbytes) for m in inserts] == [
        (BUCKET, "s1", Origin.BOUNDARY, PROMPT[:BOUNDARY], "boundary-state", 300),
        (BUCKET, "s1", Origin.COMPLETION, (*PROMPT, 7, 8), "completion-state", 600),
    ]
    assert [(m.continues, m.prompt_length) for m in inserts] == [(None, None), (41, len(PROMPT))]
    assert engine.steps[0].added[0].prefix is None  # a miss starts from scratch
    assert (stats.completed, stats.generated_tokens, stats.snapshots_dropped) == (1, 2, 0)


@pytest.mark.anyio
async def test_a_prompts_images_choose_the_bucket_it_is_looked_up_and_kept_in() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", boundary_snapshot()), out("r1", finished(1)))
    vision = VisionInputs(arrays={}, digest="images-1")
    async with caching_scheduler(engine, stats, lookups_answered(PrefixMissed())) as (store, inbox):
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send, cache_prompt=True, vision=vision), GenerationQueued)
        assert await read_all(receive) == [finished(1)]
    images_bucket = Bucket(model_id=BUCKET.model_id, media_digest="images-1")
    assert [(type(m).__name__, m.bucket) for m in store.received if isinstance(m, LookupPrefix | InsertSnapshot)] == [
        ("LookupPrefix", images_bucket),
        ("InsertSnapshot", images_bucket),
    ]
    assert engine.steps[0].added[0].vision == vision


@pytest.mark.anyio
async def test_a_full_batch_and_queue_refuse_a_request_and_close_its_stream() -> None:
    stats = SchedulerStats(max_batch=1, max_queue=1)
    engine = FakeEngine()
    async with running_scheduler(engine, stats) as inbox:
        running_send, running = event_stream()
        assert isinstance(await submit(inbox, "running", running_send), GenerationQueued)
        await engine.wait_for_steps(1)  # runs, and its step waits for its script
        waiting_send, waiting = event_stream()
        queued = await submit(inbox, "waiting", waiting_send)
        assert queued == GenerationQueued(request_id=RequestId("waiting"), queue_position=1)
        refused_send, refused = event_stream()
        reply = await submit(inbox, "refused", refused_send)
        assert isinstance(reply, RequestFailed)
        assert (reply.kind, reply.code) == (FailureKind.OVERLOADED, FailureCode.QUEUE_FULL)
        assert "capacity" in reply.message
        assert await read_all(refused) == []  # closed without an event
        assert (stats.rejected, stats.running, stats.waiting) == (1, 1, 1)
        engine.then(out("running", finished(1)))
        engine.then(out("waiting", finished(1)))
        assert await read_all(running) == [finished(1)]
        assert await read_all(waiting) == [finished(1)]
    assert added_ids(engine) == [["running"], ["waiting"]]  # the refused request never reached the engine
    assert (stats.rejected, stats.completed) == (1, 2)


@pytest.mark.parametrize("unavailable", [busy_inbox, stopped_store], ids=["busy", "stopped"])
@pytest.mark.anyio
async def test_a_store_that_cannot_answer_is_a_miss_and_loses_its_snapshots(
    unavailable: Callable[[], AbstractContextManager[MemoryObjectSendStream[Any]]],
) -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(
        out("r1", boundary_snapshot()),
        out("r1", text("Hi", 7)),
        out("r1", completion_snapshot(7)),
        out("r1", finished(1)),
    )
    with unavailable() as store:
        async with running_scheduler(engine, stats, store) as inbox:
            send, receive = event_stream()
            assert isinstance(await submit(inbox, "r1", send, cache_prompt=True), GenerationQueued)
            assert await read_all(receive) == [text("Hi", 7), finished(1)]
    assert engine.steps == [Step((engine_request("r1", boundary=BOUNDARY, snapshots=True),), ())]  # no prefix
    assert (stats.completed, stats.failed, stats.snapshots_dropped) == (1, 0, 2)


@pytest.mark.anyio
async def test_a_consumer_that_closes_its_stream_cancels_its_request_at_the_next_step() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", text("Hel", 7)))
    async with running_scheduler(engine, stats) as inbox:
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send), GenerationQueued)
        assert await receive.receive() == text("Hel", 7)
        receive.close()  # the client went away while the second step runs
        engine.then()  # that step (a prefill chunk, say) has nothing to show
        await engine.wait_for_steps(3)
        assert engine.steps[1:] == [Step((), ()), Step((), (RequestId("r1"),))]
        assert (stats.cancelled, stats.running, stats.completed, stats.failed) == (1, 0, 0, 0)


@pytest.mark.anyio
async def test_a_consumer_gone_before_its_events_arrive_leaves_the_engine_though_the_batch_empties() -> None:
    """The batch is empty once the scheduler ends it, but the engine must still be told: it holds the sequence."""
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", text("Hel", 7)))
    async with running_scheduler(engine, stats) as inbox:
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send), GenerationQueued)
        assert await receive.receive() == text("Hel", 7)
        receive.close()
        engine.then(out("r1", text("lo", 8)))  # undeliverable: the scheduler ends the request as cancelled
        await engine.wait_for_steps(3)  # the step that tells the engine, although nothing runs or waits
    assert stats.cancelled == 1
    assert [step.cancelled for step in engine.steps] == [(), (), (RequestId("r1"),)]


@pytest.mark.anyio
async def test_a_waiting_request_whose_consumer_left_never_reaches_the_engine() -> None:
    stats = SchedulerStats(max_batch=1, max_queue=2)
    engine = FakeEngine()
    async with running_scheduler(engine, stats) as inbox:
        first_send, first = event_stream()
        assert isinstance(await submit(inbox, "first", first_send), GenerationQueued)
        await engine.wait_for_steps(1)
        left_send, left = event_stream()
        assert isinstance(await submit(inbox, "left", left_send), GenerationQueued)
        left.close()
        last_send, last = event_stream()
        assert isinstance(await submit(inbox, "last", last_send), GenerationQueued)
        engine.then(out("first", finished(1)))
        assert await read_all(first) == [finished(1)]
        await engine.wait_for_steps(2)
        assert added_ids(engine) == [["first"], ["last"]]
        assert (stats.cancelled, stats.completed, stats.running, stats.waiting) == (1, 1, 1, 0)
        engine.then(out("last", finished(1)))
        assert await read_all(last) == [finished(1)]


@pytest.mark.anyio
async def test_shutdown_fails_every_open_stream_then_asks_find_the_actor_stopped() -> None:
    stats = SchedulerStats(max_batch=1, max_queue=1)
    engine = FakeEngine()
    engine.then(out("running", text("Hel", 7)))
    async with running_scheduler(engine, stats) as inbox:
        running_send, running = event_stream()
        assert isinstance(await submit(inbox, "running", running_send), GenerationQueued)
        assert await running.receive() == text("Hel", 7)
        await engine.wait_for_steps(2)  # mid-generation: its second step has not answered
        waiting_send, waiting = event_stream()
        assert isinstance(await submit(inbox, "waiting", waiting_send), GenerationQueued)
        assert (stats.running, stats.waiting) == (1, 1)
    assert await read_all(running) == [SHUTDOWN]
    assert await read_all(waiting) == [SHUTDOWN]
    assert (stats.failed, stats.completed, stats.running, stats.waiting) == (2, 0, 0, 0)
    late_send, late = event_stream()
    with late_send, late, pytest.raises(ActorStopped):
        await submit(inbox, "late", late_send)
    assert added_ids(engine) == [["running"], []]


@pytest.mark.anyio
async def test_a_warm_up_the_store_already_extended_is_skipped_without_the_model() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    history = (*PROMPT, 7, 8)
    async with caching_scheduler(engine, stats, lookups_answered(PrefixMissed(extended=True))) as (store, inbox):
        await inbox.send(QueueWarmUp(session="s1", tokens=history))
        await store.wait_for(1)
        await anyio.wait_all_tasks_blocked()  # the scheduler has taken the answer and gone idle
        assert warm_up_counts(stats) == {"queued": 1, "skipped": 1, "run": 0, "paused": 0, "pending": 0}
    lookup = store.received[0]
    assert isinstance(lookup, LookupPrefix)
    assert (lookup.bucket, lookup.session, lookup.tokens, lookup.check_extended) == (BUCKET, "s1", history, True)
    assert store.kinds == ["LookupPrefix"]  # nothing inserted
    assert (engine.model_reads, engine.steps) == (0, [])


def warm_up_counts(stats: SchedulerStats) -> dict[str, int]:
    return {name.removeprefix("warmups_"): n for name, n in stats.as_dict().items() if name.startswith("warmups_")}


class ScriptedWarmUp:
    """Stands in for `engine.warm_up.WarmUp`: `CHUNKS` chunks to prefill on the MLX thread, the first held there
    until the test lets it go (a long chunk, during which live work arrives)."""

    CHUNKS = 2

    def __init__(self, jobs: WarmUpJobs, tokens: tuple[int, ...], prefix: CachedPrefix | None) -> None:
        self.tokens, self.prefix, self.done = tokens, prefix, 0
        self.release_first_chunk = threading.Event()
        self._jobs = jobs

    @property
    def finished(self) -> bool:
        return self.done >= self.CHUNKS

    def advance(self) -> None:
        if self.done == 0:
            self._jobs.chunk_started()
            self.release_first_chunk.wait(TIMEOUT_S)
        self.done += 1

    def snapshot(self) -> SnapshotTaken:
        return SnapshotTaken(origin=Origin.BOUNDARY, tokens=self.tokens, state="warm-state", nbytes=500)


class WarmUpJobs:
    """The warm-up jobs the scheduler made, in order (`make` replaces `WarmUp`)."""

    def __init__(self) -> None:
        self.made: list[ScriptedWarmUp] = []
        self._started = 0
        self._condition = threading.Condition()

    def make(self, model: object, tokens: tuple[int, ...], prefix: CachedPrefix | None, *_: object) -> ScriptedWarmUp:
        job = ScriptedWarmUp(self, tokens, prefix)
        self.made.append(job)
        return job

    def chunk_started(self) -> None:
        with self._condition:
            self._started += 1
            self._condition.notify_all()

    async def first_chunk_started(self, count: int) -> ScriptedWarmUp:
        """The `count`-th job, once it has begun its first chunk on the MLX thread (waited for on a worker thread)."""

        def wait() -> None:
            with self._condition:
                self._condition.wait_for(lambda: self._started >= count, TIMEOUT_S)

        await anyio.to_thread.run_sync(wait)
        return self.made[count - 1]


@pytest.fixture
def warm_up_jobs(monkeypatch: pytest.MonkeyPatch) -> WarmUpJobs:
    """Every warm-up job the scheduler makes is a `ScriptedWarmUp`."""
    jobs = WarmUpJobs()
    monkeypatch.setattr("courier.actors.scheduling.warm_ups.WarmUp", jobs.make)
    return jobs


@pytest.mark.anyio
async def test_a_warm_up_live_work_interrupts_keeps_its_place_and_its_progress(warm_up_jobs: WarmUpJobs) -> None:
    """Dropped, the conversation's next turn prefills its whole last reply again (issue 30: on a busy machine the
    next request often arrives while a warm-up runs, and 8 interleaved conversations fell from 97.1% cached to 95%)."""
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    history = (*PROMPT, 7, 8)
    async with caching_scheduler(engine, stats, lookups_answered(HISTORY_FOUND)) as (store, inbox):
        await inbox.send(QueueWarmUp(session="s1", tokens=history))
        job = await warm_up_jobs.first_chunk_started(1)
        send, receive = event_stream()  # a live request arrives during the warm-up's first chunk
        assert isinstance(await submit(inbox, "r1", send), GenerationQueued)
        job.release_first_chunk.set()
        engine.then(out("r1", finished(1)))
        assert await read_all(receive) == [finished(1)]  # it ran first, the warm-up waiting
        await store.wait_for(3)  # idle again: the warm-up asks once more and finishes
        assert warm_up_counts(stats) == {"queued": 1, "skipped": 0, "run": 1, "paused": 1, "pending": 0}
    assert warm_up_jobs.made == [job]  # resumed, not begun again: its first chunk is not prefilled twice
    assert job.done == ScriptedWarmUp.CHUNKS
    assert job.prefix == CachedPrefix(state="history-state", length=3, matched=3, continues=41)
    assert store.kinds == ["LookupPrefix", "LookupPrefix", "InsertSnapshot"]
    insert = store.received[2]
    assert isinstance(insert, InsertSnapshot)
    assert (insert.origin, insert.tokens, insert.state) == (Origin.BOUNDARY, history, "warm-state")
    assert added_ids(engine) == [["r1"]]


@pytest.mark.anyio
async def test_a_newer_warm_up_of_the_conversation_replaces_a_paused_one(warm_up_jobs: WarmUpJobs) -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    older, newer = (*PROMPT, 7, 8), (*PROMPT, 7, 8, 9, 10)
    async with caching_scheduler(engine, stats, lookups_answered(HISTORY_FOUND)) as (store, inbox):
        await inbox.send(QueueWarmUp(session="s1", tokens=older))
        first = await warm_up_jobs.first_chunk_started(1)
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r1", send), GenerationQueued)
        first.release_first_chunk.set()
        await engine.wait_for_steps(1)  # the warm-up is paused, the request runs
        await inbox.send(QueueWarmUp(session="s1", tokens=newer))  # the conversation moved on meanwhile
        engine.then(out("r1", finished(1)))
        assert await read_all(receive) == [finished(1)]
        second = await warm_up_jobs.first_chunk_started(2)
        second.release_first_chunk.set()
        await store.wait_for(3)
        assert warm_up_counts(stats) == {"queued": 2, "skipped": 1, "run": 1, "paused": 1, "pending": 0}
    assert [job.tokens for job in warm_up_jobs.made] == [older, newer]
    insert = store.received[2]
    assert isinstance(insert, InsertSnapshot)
    assert insert.tokens == newer


@pytest.mark.parametrize("unanswered", ["busy", "late"])
@pytest.mark.anyio
async def test_a_warm_up_whose_lookup_goes_unanswered_is_skipped_not_prefilled_cold(unanswered: str) -> None:
    """A store late under load is no reason to prefill a whole conversation again: that adds to the load."""
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    never = anyio.Event()

    async def silent(message: SnapshotStoreMessage) -> None:
        await never.wait()

    if unanswered == "busy":
        with busy_inbox() as store_send:
            async with running_scheduler(engine, stats, store_send) as inbox:
                await inbox.send(QueueWarmUp(session="s1", tokens=(*PROMPT, 7, 8)))
                await anyio.wait_all_tasks_blocked()
                counts = warm_up_counts(stats)
    else:
        async with store_neighbour(silent) as store:
            # A deadline of 0 has passed by the time the lookup waits: late, without waiting on a real clock.
            async with running_scheduler(engine, stats, store.send, lookup_timeout_s=0.0) as inbox:
                await inbox.send(QueueWarmUp(session="s1", tokens=(*PROMPT, 7, 8)))
                await store.wait_for(1)
                with anyio.fail_after(5):  # the cancelled ask winds its waiting task down over a few loop turns
                    while stats.lookups_timed_out < 1:
                        await anyio.wait_all_tasks_blocked()
                await anyio.wait_all_tasks_blocked()
                counts = warm_up_counts(stats)
                assert stats.lookups_timed_out == 1
            never.set()
    assert counts == {"queued": 1, "skipped": 1, "run": 0, "paused": 0, "pending": 0}
    assert (engine.model_reads, engine.steps) == (0, [])  # no cold prefill of the history


@pytest.mark.anyio
async def test_the_store_lookup_joins_the_requests_trace(span_exporter: InMemorySpanExporter) -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", finished(1)))
    async with caching_scheduler(engine, stats, lookups_answered(PrefixMissed())) as (store, inbox):
        send, receive = event_stream()
        with tracer().start_as_current_span("client") as client:
            assert isinstance(await submit(inbox, "r1", send, cache_prompt=True), GenerationQueued)
        assert await read_all(receive) == [finished(1)]
    handled = [span for span in span_exporter.get_finished_spans() if span.name == "scheduler.SubmitGeneration"]
    assert len(handled) == 1
    assert handled[0].parent is not None
    assert handled[0].parent.span_id == client.get_span_context().span_id
    lookup = store.received[0]
    assert isinstance(lookup, LookupPrefix)
    _, trace_id, parent_id, _ = lookup.trace["traceparent"].split("-")
    assert (int(trace_id, 16), int(parent_id, 16)) == (client.get_span_context().trace_id, handled[0].context.span_id)


def sample_finished(choice: int) -> GenerationFinished:
    return GenerationFinished(reason=FinishReason.STOP, prompt_tokens=len(PROMPT), completion_tokens=1, choice=choice)


@pytest.mark.anyio
async def test_samples_take_a_slot_each_and_the_request_ends_with_the_last() -> None:
    stats = SchedulerStats(max_batch=3, max_queue=4)
    engine = FakeEngine()
    async with running_scheduler(engine, stats) as inbox:
        one_send, one = event_stream()
        assert isinstance(await submit(inbox, "one", one_send), GenerationQueued)
        await engine.wait_for_steps(1)
        three_send, three = event_stream()
        assert isinstance(await submit(inbox, "three", three_send, n=3), GenerationQueued)
        assert (stats.running, stats.waiting) == (1, 3)  # counted in sequences; three do not fit beside one
        engine.then(out("one", finished(1)))
        assert await read_all(one) == [finished(1)]
        await engine.wait_for_steps(2)
        engine.then(out("three", sample_finished(1)), out("three", sample_finished(0)))
        await engine.wait_for_steps(3)
        assert (stats.running, stats.completed) == (3, 1)  # two of its samples finished: still running
        engine.then(out("three", sample_finished(2)))
        assert await read_all(three) == [sample_finished(1), sample_finished(0), sample_finished(2)]
    assert added_ids(engine)[:2] == [["one"], ["three"]]
    assert engine.steps[1].added[0].n == 3
    assert (stats.completed, stats.running, stats.cancelled) == (2, 0, 0)


@pytest.mark.anyio
async def test_one_failed_sample_fails_the_request_and_takes_the_others_out() -> None:
    stats = SchedulerStats(max_batch=4, max_queue=4)
    engine = FakeEngine()
    failure = GenerationFailed(message="generation failed: boom", choice=1)
    engine.then(out("r", failure))
    async with running_scheduler(engine, stats) as inbox:
        send, receive = event_stream()
        assert isinstance(await submit(inbox, "r", send, n=2), GenerationQueued)
        assert await read_all(receive) == [failure]
        await engine.wait_for_steps(2)
        engine.then()
    assert engine.steps[1] == Step((), (RequestId("r"),))  # the other sample leaves the batch
    assert (stats.failed, stats.cancelled, stats.running) == (1, 0, 0)


@pytest.mark.anyio
async def test_samples_beyond_the_batch_and_queue_are_refused() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=1)
    engine = FakeEngine()
    async with running_scheduler(engine, stats) as inbox:
        send, receive = event_stream()
        reply = await submit(inbox, "wide", send, n=4)
        assert isinstance(reply, RequestFailed) and reply.code == FailureCode.QUEUE_FULL
        assert await read_all(receive) == []
    assert engine.steps == []


@pytest.mark.anyio
async def test_a_store_that_answers_too_late_is_a_miss_and_the_request_runs() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    engine.then(out("r1", text("Hi", 7)), out("r1", finished(1)))
    release = anyio.Event()

    async def slow(message: SnapshotStoreMessage) -> LookupReply | None:
        if isinstance(message, LookupPrefix):
            await release.wait()  # a store stuck behind other work
            return HISTORY_FOUND
        return None

    async with store_neighbour(slow) as store:
        mlx = MlxThread()
        caching = PromptCaching(store=store.send, bucket=BUCKET)
        actor = SchedulerActor(mlx, lambda: cast(BatchEngine, engine), stats, caching=caching, lookup_timeout_s=0.05)
        try:
            with anyio.fail_after(TIMEOUT_S):
                async with run_actor(actor) as inbox:
                    send, receive = event_stream()
                    assert isinstance(await submit(inbox, "r1", send, cache_prompt=True), GenerationQueued)
                    assert await read_all(receive) == [text("Hi", 7), finished(1)]
        finally:
            release.set()
            engine.close()
            mlx.close(timeout=TIMEOUT_S)
    assert engine.steps[0] == Step((engine_request("r1", boundary=BOUNDARY, snapshots=True),), ())  # no prefix
    assert (stats.lookups_timed_out, stats.completed) == (1, 1)


@pytest.mark.anyio
async def test_a_lookup_still_out_holds_up_only_its_own_request() -> None:
    release = anyio.Event()

    async def slow(message: SnapshotStoreMessage) -> LookupReply | None:
        if isinstance(message, LookupPrefix):
            await release.wait()  # a store reading a large snapshot back from disk
            return HISTORY_FOUND
        return None

    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    async with caching_scheduler(engine, stats, slow) as (store, inbox):
        running_send, running_receive = event_stream()
        assert isinstance(await submit(inbox, "r1", running_send), GenerationQueued)  # no lookup
        await engine.wait_for_steps(1)
        waiting_send, waiting_receive = event_stream()
        assert isinstance(await submit(inbox, "r2", waiting_send, cache_prompt=True), GenerationQueued)
        await store.wait_for(1)  # r2's lookup is out
        engine.then(out("r1", text("a", 1)))
        engine.then(out("r1", text("b", 2)))
        engine.then(out("r1", finished(2)))
        assert await read_all(running_receive) == [text("a", 1), text("b", 2), finished(2)]
        release.set()
        engine.then(out("r2", finished(1, cached_tokens=3)))
        assert await read_all(waiting_receive) == [finished(1, cached_tokens=3)]
    prefix = CachedPrefix(state="history-state", length=3, matched=3, continues=41)
    added = [step.added for step in engine.steps if step.added]
    # r1 stepped to its end while r2's lookup was out; r2 joined with what the lookup found.
    assert added == [
        (engine_request("r1", boundary=0, snapshots=False),),
        (engine_request("r2", prefix=prefix, boundary=BOUNDARY, snapshots=True),),
    ]
    assert [step.added for step in engine.steps[:3]] == [(engine_request("r1", boundary=0, snapshots=False),), (), ()]
    assert stats.lookups_timed_out == 0


@pytest.mark.anyio
async def test_a_request_still_waiting_at_its_deadline_fails_as_timed_out_and_never_reaches_the_engine() -> None:
    stats = SchedulerStats(max_batch=1, max_queue=2)
    engine, clock = FakeEngine(), FakeClock()
    async with running_scheduler(engine, stats, clock=clock) as inbox:
        first_send, first = event_stream()
        assert isinstance(await submit(inbox, "first", first_send), GenerationQueued)
        await engine.wait_for_steps(1)
        late_send, late = event_stream()
        assert isinstance(await submit(inbox, "late", late_send, deadline=clock.now + 5), GenerationQueued)
        clock.now += 6
        engine.then(out("first", text("a", 1)))
        events = await read_all(late)
        assert events == [GenerationFailed(message=DEADLINE_MESSAGE, code=FailureCode.DEADLINE_EXCEEDED)]
        assert (stats.timed_out, stats.failed, stats.waiting) == (1, 0, 0)
        engine.then(out("first", finished(2)))
        assert await read_all(first) == [text("a", 1), finished(2)]
    assert added_ids(engine)[:2] == [["first"], []]


@pytest.mark.anyio
async def test_a_running_request_at_its_deadline_is_handed_to_the_engine_once_to_end_with_what_it_wrote() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine, clock = FakeEngine(), FakeClock()
    cut = replace(finished(1), reason=FinishReason.LENGTH, deadline=True)
    async with running_scheduler(engine, stats, clock=clock) as inbox:
        events_send, events = event_stream()
        assert isinstance(await submit(inbox, "r1", events_send, deadline=clock.now + 5), GenerationQueued)
        await engine.wait_for_steps(1)
        engine.then(out("r1", text("a", 1)))  # before its deadline: nothing expires
        await engine.wait_for_steps(2)
        clock.now += 6
        engine.then()
        await engine.wait_for_steps(3)
        engine.then(out("r1", cut))  # what the engine answers for a request it was told had expired
        assert await read_all(events) == [text("a", 1), cut]
    assert [step.expired for step in engine.steps[:3]] == [(), (), (RequestId("r1"),)]
    assert (stats.completed, stats.cut_at_deadline, stats.timed_out) == (1, 1, 0)


# An agent-sized prompt (past the length under which a request never waits for another's prefill).
LONG = tuple(range(1000, 1400))


async def submit_long(inbox: Inbox, request_id: str, events: EventsSend, prompt: tuple[int, ...] = LONG) -> None:
    queued: SubmitReply = await ask(
        inbox,
        lambda reply: SubmitGeneration(
            request_id=RequestId(request_id),
            prompt_tokens=prompt,
            sampling=SAMPLING,
            events=events,
            session="s1",
            boundary=0,
            cache_prompt=True,
            reply=reply,
        ),
    )
    assert isinstance(queued, GenerationQueued)


def missed_then_found(state: str, length: int) -> Callable[[SnapshotStoreMessage], LookupReply | None]:
    """The first lookup misses; later ones find `state` covering the first `length` tokens."""
    lookups = 0

    def answer(message: SnapshotStoreMessage) -> LookupReply | None:
        nonlocal lookups
        if not isinstance(message, LookupPrefix):
            return None
        lookups += 1
        return (
            PrefixMissed()
            if lookups == 1
            else PrefixFound(state=state, length=length, matched=length, trimmed=False, continues=None)
        )

    return answer


def kept_state(tokens: tuple[int, ...], state: str) -> SnapshotTaken:
    return SnapshotTaken(origin=Origin.BOUNDARY, tokens=tokens, state=state, nbytes=900)


@pytest.mark.anyio
async def test_the_same_request_sent_while_the_first_prefills_waits_and_starts_from_its_state() -> None:
    """Not a second prefill of the same tokens beside the first: it looks up once the first's state is in the store
    (the prompt but its last token, the boundary snapshot every caching request takes)."""
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    covered = len(LONG) - 1
    async with caching_scheduler(engine, stats, missed_then_found("prompt-state", covered)) as (store, inbox):
        first_send, first = event_stream()
        await submit_long(inbox, "first", first_send)
        await engine.wait_for_steps(1)  # the first prefills (its step waits)
        again_send, again = event_stream()
        await submit_long(inbox, "again", again_send)
        engine.then()  # a prefill chunk: nothing to show
        await engine.wait_for_steps(2)
        engine.then(out("first", kept_state(LONG[:-1], "prompt-state")), out("first", text("Hi", 7)))
        await store.wait_for(3)  # its lookup, once the first's state went to the store
        engine.then(out("first", finished(1)))
        assert await read_all(first) == [text("Hi", 7), finished(1)]
        engine.then(out("again", finished(1, cached_tokens=covered)))  # it has joined by this step
        assert await read_all(again) == [finished(1, cached_tokens=covered)]
    assert store.kinds == ["LookupPrefix", "InsertSnapshot", "LookupPrefix"]  # the second lookup after the insert
    (resent,) = [request for step in engine.steps for request in step.added if request.request_id == "again"]
    assert resent.prefix == CachedPrefix(state="prompt-state", length=covered, matched=covered)
    assert added_ids(engine)[:2] == [["first"], []]  # not beside the first while it prefilled


@pytest.mark.anyio
async def test_a_resend_after_the_first_was_cancelled_starts_from_what_it_had_prefilled() -> None:
    """The client gave up on the first (its stream closed) and sent it again: the cancelled request's prefill so far
    goes to the store under its session (the engine hands it over in the step that takes it out), and the resend,
    arriving meanwhile, looks up only after that."""
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    async with caching_scheduler(engine, stats, missed_then_found("partial-state", 256)) as (store, inbox):
        first_send, first = event_stream()
        await submit_long(inbox, "first", first_send)
        await engine.wait_for_steps(1)
        first.close()  # the client gave up
        engine.then()
        await engine.wait_for_steps(2)  # the step that takes it out of the batch
        assert engine.steps[1].cancelled == (RequestId("first"),)
        again_send, again = event_stream()
        await submit_long(inbox, "again", again_send)
        engine.then(out("first", kept_state(LONG[:256], "partial-state")))
        await engine.wait_for_steps(3)  # nothing else runs: the next step is the one it joins
        engine.then(out("again", finished(1, cached_tokens=256)))
        assert await read_all(again) == [finished(1, cached_tokens=256)]
    assert store.kinds == ["LookupPrefix", "InsertSnapshot", "LookupPrefix"]
    insert = store.received[1]
    assert isinstance(insert, InsertSnapshot)
    assert (insert.session, insert.bucket, insert.tokens, insert.state) == ("s1", BUCKET, LONG[:256], "partial-state")
    assert added_ids(engine) == [["first"], [], ["again"]]
    assert engine.steps[2].added[0].prefix == CachedPrefix(state="partial-state", length=256, matched=256)
    assert stats.cancelled == 1


@pytest.mark.anyio
async def test_a_request_that_only_shares_a_start_with_one_prefilling_does_not_wait_for_it() -> None:
    stats = SchedulerStats(max_batch=2, max_queue=2)
    engine = FakeEngine()
    async with caching_scheduler(engine, stats, lookups_answered(PrefixMissed())) as (store, inbox):
        first_send, first = event_stream()
        await submit_long(inbox, "first", first_send)
        await engine.wait_for_steps(1)
        other_send, other = event_stream()
        await submit_long(inbox, "other", other_send, prompt=(*LONG[:300], 1, 2, 3))
        await store.wait_for(2)  # looked up at once, while the first still prefills
        engine.then()
        await engine.wait_for_steps(2)
        engine.then(out("first", finished(1)), out("other", finished(1)))
        assert await read_all(first) == [finished(1)]
        assert await read_all(other) == [finished(1)]
    assert added_ids(engine)[:2] == [["first"], ["other"]]
