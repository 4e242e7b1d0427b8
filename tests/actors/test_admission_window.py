"""An idle scheduler's admission window (`--admission-window-ms`), over real anyio streams and a real MLX thread with
the scripted engine of `tests/support/fake_engine.py`: a burst gathers when the step ahead is long, a lone request
whose step is short goes in at once, and a warm-up never waits for a burst. A wait the scheduler should not make
would run into the test's timeout (the windows here are longer than it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from courier.actors.prompt_cache.store_link import PromptCaching
from courier.actors.scheduler import SchedulerActor
from courier.core.prompt_cache.entries import Bucket
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineOutput
from courier.engine.generation import FinishReason, GenerationEvent, GenerationFinished, RequestId, SamplingParams
from courier.messages.scheduler import (
    GenerationQueued,
    QueueWarmUp,
    SchedulerMessage,
    SubmitGeneration,
    SubmitReply,
)
from courier.messages.snapshot_store import LookupPrefix, PrefixFound, PrefixMissed, SnapshotStoreMessage
from courier.runtime.actor import ask
from courier.runtime.mlx_thread import MlxThread
from courier.status.scheduler_stats import SchedulerStats
from tests.support.actors import FakeNeighbour, run_actor, start_neighbours
from tests.support.fake_engine import FakeEngine

TIMEOUT_S = 10.0
LONGER_THAN_THE_TEST_S = 60.0
BUCKET = Bucket(model_id="tiny-model")
PROMPT = (11, 12, 13, 14, 15, 16)
Inbox = MemoryObjectSendStream[SchedulerMessage]


@asynccontextmanager
async def scheduler(
    engine: FakeEngine, stats: SchedulerStats, window_s: float, found: PrefixFound | PrefixMissed
) -> AsyncIterator[tuple[FakeNeighbour[SnapshotStoreMessage], Inbox]]:
    """The scheduler with an admission window, caching into a fake store that answers every lookup `found`."""
    store: FakeNeighbour[SnapshotStoreMessage] = FakeNeighbour(
        lambda message: found if isinstance(message, LookupPrefix) else None
    )
    mlx = MlxThread()
    actor = SchedulerActor(
        mlx,
        lambda: cast(BatchEngine, engine),
        stats,
        caching=PromptCaching(store=store.send, bucket=BUCKET),
        admission_window_s=window_s,
    )
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tasks:
                await start_neighbours(tasks, store)
                with store.send:
                    async with run_actor(actor) as inbox:
                        yield store, inbox
    finally:
        engine.close()
        mlx.close(timeout=TIMEOUT_S)


async def submit(inbox: Inbox, request_id: str, n: int = 1) -> MemoryObjectReceiveStream[GenerationEvent]:
    """The request's events are buffered, not read: the engine's steps are what the tests look at."""
    send, receive = anyio.create_memory_object_stream[GenerationEvent](16)
    reply: SubmitReply = await ask(
        inbox,
        lambda reply: SubmitGeneration(
            request_id=RequestId(request_id),
            prompt_tokens=PROMPT,
            sampling=SamplingParams(max_tokens=4, temperature=0.0),
            events=send,
            session=request_id,
            boundary=len(PROMPT) - 1,
            cache_prompt=True,
            reply=reply,
            n=n,
        ),
    )
    assert isinstance(reply, GenerationQueued)
    return receive


def finished(request_id: str) -> EngineOutput:
    done = GenerationFinished(reason=FinishReason.STOP, prompt_tokens=len(PROMPT), completion_tokens=0)
    return EngineOutput(RequestId(request_id), done)


def window_counts(stats: SchedulerStats) -> tuple[int, int]:
    return stats.admission_windows_waited, stats.admission_windows_skipped


@pytest.mark.anyio
async def test_a_lone_request_whose_step_is_short_goes_in_without_waiting_the_window() -> None:
    stats, engine = SchedulerStats(max_batch=4, max_queue=4), FakeEngine()
    engine.admission_estimate = 0.002  # the step ahead: 2 ms
    engine.then(finished("r1"))
    cached = PrefixFound(state="history", length=4, matched=4, trimmed=False, continues=15)
    async with scheduler(engine, stats, LONGER_THAN_THE_TEST_S, cached) as (store, inbox):
        with await submit(inbox, "r1"):
            await engine.wait_for_steps(1)
    assert [request.request_id for request in engine.steps[0].added] == ["r1"]
    assert engine.admissions_estimated == [[(4, 2)]]  # asked once its lookup answered: 4 cached, 2 to prefill
    assert window_counts(stats) == (0, 1)
    assert store.kinds[0] == "LookupPrefix"


@pytest.mark.anyio
async def test_a_burst_gathers_into_one_step_when_the_step_ahead_is_long() -> None:
    stats, engine = SchedulerStats(max_batch=4, max_queue=4), FakeEngine()
    engine.admission_estimate = 5.0  # the step ahead: longer than the window
    engine.then(finished("r1"), finished("r2"))
    async with scheduler(engine, stats, 1.0, PrefixMissed()) as (_, inbox):
        with await submit(inbox, "r1"), await submit(inbox, "r2"):  # r2 within the window r1 waits
            await engine.wait_for_steps(1)
    assert [request.request_id for request in engine.steps[0].added] == ["r1", "r2"]
    # r1 alone may have been estimated (long: it waits), or both were waiting already (a burst: no estimate).
    assert engine.admissions_estimated in ([], [[(0, len(PROMPT))]])
    assert window_counts(stats) == (1, 0)


@pytest.mark.anyio
async def test_a_request_of_several_samples_waits_the_window_however_short_its_step() -> None:
    """Its admission prefills the whole prompt to fork it, more than the one chunk the estimate prices."""
    stats, engine = SchedulerStats(max_batch=4, max_queue=4), FakeEngine()
    engine.admission_estimate = 0.001
    engine.then(finished("r1"))
    async with scheduler(engine, stats, 0.2, PrefixMissed()) as (_, inbox):
        with await submit(inbox, "r1", n=2):
            await engine.wait_for_steps(1)
    assert [request.request_id for request in engine.steps[0].added] == ["r1"]
    assert engine.admissions_estimated == [] and window_counts(stats) == (1, 0)


@pytest.mark.anyio
async def test_a_warm_up_on_an_idle_scheduler_starts_without_waiting_for_a_burst() -> None:
    stats, engine = SchedulerStats(max_batch=4, max_queue=4), FakeEngine()
    async with scheduler(engine, stats, LONGER_THAN_THE_TEST_S, PrefixMissed(extended=True)) as (store, inbox):
        await inbox.send(QueueWarmUp(session="s1", tokens=(*PROMPT, 7)))
        await store.wait_for(1)  # its lookup: asked at once, not a window later
        await anyio.wait_all_tasks_blocked()
        assert (stats.warmups_skipped, window_counts(stats)) == (1, (0, 0))
    assert engine.admissions_estimated == [] and engine.steps == []
