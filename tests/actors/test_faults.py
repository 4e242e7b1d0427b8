"""Fault isolation, actor by actor: a handler that raises fails its own request only.

For each actor a real input makes its handler raise something no handler expects (a
neighbour's malformed answer, a backend or core that breaks). The request gets a 500
`internal_error` (or, for a message that asks no reply, nothing), the fault is counted
for that actor, and the very next message is served as usual. `BrokenInvariant` alone
still stops an actor. The token counter's case is in `test_token_counter.py`; the
media fetcher's inputs are all per-part failures, in `test_media_fetcher.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from courier.actors.compactor import CompactorActor, CompactorLimits
from courier.actors.ingress import IngressActor
from courier.actors.prompt_cache.snapshot_store import SnapshotStoreActor
from courier.actors.prompt_cache.store_link import PromptCaching
from courier.actors.scheduler import SchedulerActor
from courier.actors.storage import StorageActor
from courier.conversation.capsule import CapsuleCodec
from courier.conversation.images import ImageAdmission
from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.entries import Bucket
from courier.core.prompt_cache.stats import StoreLimits
from courier.core.prompt_cache.store import SnapshotStore
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineOutput
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
)
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.compactor import CompactHistory
from courier.messages.ingress import AdmitGeneration, Admitted, IngressMessage, TextPrompt, TokenPrompt
from courier.messages.scheduler import GenerationQueued, SchedulerMessage, SubmitGeneration
from courier.messages.snapshot_store import LookupPrefix, LookupReply, ReadSnapshotStats, SnapshotStoreMessage
from courier.messages.storage import LoadResponse, SaveResponse, StorageMessage
from courier.messages.token_counter import TokenCounterMessage, TokenizeResult
from courier.runtime.actor import Actor, ActorStopped, ask
from courier.runtime.faults import BrokenInvariant, FaultCounter
from courier.runtime.mlx_thread import MlxThread
from courier.status.scheduler_stats import AdmissionStats, SchedulerStats
from courier.storage.records import StorageLimits, StoredResponse
from courier.storage.sqlite import SqliteStorage
from tests.support.actors import FakeNeighbour, run_actor, start_neighbours
from tests.support.fake_engine import FakeEngine
from tests.support.records import response

pytestmark = pytest.mark.anyio

TIMEOUT_S = 10.0
INTERNAL = (FailureKind.INTERNAL, FailureCode.INTERNAL_ERROR)


def internal(raised: pytest.ExceptionInfo[Refused]) -> tuple[FailureKind, FailureCode | None]:
    return raised.value.failure.kind, raised.value.failure.code


async def test_ingress_a_malformed_answer_from_a_neighbour_fails_that_admission_only() -> None:
    # The token counter answers something that is not a TokenizeResult: the ingress's handler raises on it.
    counter: FakeNeighbour[TokenCounterMessage] = FakeNeighbour(lambda _: object())
    scheduler: FakeNeighbour[SchedulerMessage] = FakeNeighbour(
        lambda message: GenerationQueued(request_id=message.request_id, queue_position=1)  # type: ignore[union-attr]
    )
    faults = FaultCounter()
    actor = IngressActor(
        counter.send,
        scheduler.send,
        context_length=64,
        vocabulary_size=100,
        images=ImageAdmission(max_images=2, model_id="tiny", fetcher=None),
        scheduler_stats=SchedulerStats(max_batch=2, max_queue=2),
        stats=AdmissionStats(),
    )
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tasks:
            await start_neighbours(tasks, counter, scheduler)
            async with run_actor(actor, faults=faults) as inbox:
                with pytest.raises(Refused) as raised:
                    await admit(inbox, TextPrompt(text="hello"))
                admitted = await admit(inbox, TokenPrompt(tokens=(1, 2, 3)))
                admitted.events.close()
            tasks.cancel_scope.cancel()
    for queued in scheduler.received:  # what a real scheduler closes once the generation ends
        queued.events.close()  # type: ignore[union-attr]
    assert internal(raised) == INTERNAL
    assert faults.by_actor() == {"ingress": 1}
    assert admitted.prompt_tokens == 3


async def admit(inbox: Any, prompt: TextPrompt | TokenPrompt) -> Admitted:
    return await call(
        inbox,
        lambda reply: AdmitGeneration(
            request_id=RequestId("r"),
            prompt=prompt,
            sampling=SamplingParams(max_tokens=4),
            session="",
            cache_prompt=False,
            reply=reply,
        ),
    )


class MalformedVision:
    """Stands where a prompt's `VisionInputs` go, without the digest the scheduler reads."""


async def test_scheduler_a_malformed_submission_fails_alone_and_the_next_runs() -> None:
    engine = FakeEngine()
    stats = SchedulerStats(max_batch=2, max_queue=2)
    store: FakeNeighbour[SnapshotStoreMessage] = FakeNeighbour()
    faults = FaultCounter()
    mlx = MlxThread()
    actor = SchedulerActor(
        mlx, lambda: cast(BatchEngine, engine), stats, caching=PromptCaching(store=store.send, bucket=Bucket("m"))
    )
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tasks:
                await start_neighbours(tasks, store)
                async with run_actor(actor, faults=faults) as inbox:
                    bad_send, bad_receive = anyio.create_memory_object_stream[GenerationEvent](4)
                    with pytest.raises(Refused) as raised:
                        await submit(inbox, "bad", bad_send, vision=MalformedVision())
                    send, receive = anyio.create_memory_object_stream[GenerationEvent](4)
                    engine.then(EngineOutput(RequestId("good"), TokensGenerated(text="ok", token_ids=(5,))))
                    engine.then(EngineOutput(RequestId("good"), finished()))
                    assert isinstance(await submit(inbox, "good", send), GenerationQueued)
                    async with receive:
                        events = [event async for event in receive]
                    bad_send.close()
                    bad_receive.close()
                tasks.cancel_scope.cancel()
    finally:
        engine.close()
        mlx.close(timeout=TIMEOUT_S)
    assert internal(raised) == INTERNAL
    assert faults.by_actor() == {"scheduler": 1}
    assert events == [TokensGenerated(text="ok", token_ids=(5,)), finished()]
    assert [request.request_id for step in engine.steps for request in step.added] == ["good"]


def finished() -> GenerationFinished:
    return GenerationFinished(reason=FinishReason.STOP, prompt_tokens=3, completion_tokens=1)


async def submit(inbox: Any, request_id: str, events: Any, vision: Any = None) -> GenerationQueued:
    return await call(
        inbox,
        lambda reply: SubmitGeneration(
            request_id=RequestId(request_id),
            prompt_tokens=(1, 2, 3),
            sampling=SamplingParams(max_tokens=4),
            events=events,
            reply=reply,
            session="",
            boundary=0,
            cache_prompt=True,
            vision=vision,
        ),
    )


class BrokenLookups(SnapshotStore):
    """A store whose lookups break (a bug in the core): the actor holding it must not."""

    def lookup(self, bucket: Bucket, session: str, tokens: Sequence[int], *, find_divergence: bool = False) -> Any:
        raise RuntimeError("broken index")


async def test_snapshot_store_a_broken_lookup_is_a_miss_for_its_asker_and_the_store_serves_on() -> None:
    limits = StoreLimits(capacity_bytes=1000, max_entries=10, ttl_s=60.0, min_prefix=1)
    faults = FaultCounter()
    store = BrokenLookups(limits, trimmable=True, clock=lambda: 0.0)
    with anyio.fail_after(TIMEOUT_S):
        async with run_actor(SnapshotStoreActor(store), faults=faults) as inbox:
            with pytest.raises(ActorStopped):  # a lookup asks no typed reply: its asker (the scheduler) sees a miss
                lookup: LookupReply = await ask(
                    inbox,
                    lambda reply: LookupPrefix(bucket=Bucket("m"), session="s", tokens=(1, 2), reply=reply),
                )
                del lookup
            stats = await call(inbox, lambda reply: ReadSnapshotStats(reply=reply))
    assert faults.by_actor() == {"snapshot_store": 1}
    assert stats.entries == 0


class DamagedBackend(SqliteStorage):
    """A backend that breaks reading one id in a way the actor does not expect."""

    def load_response(self, response_id: str) -> StoredResponse | None:
        if response_id == "resp_broken":
            raise RuntimeError("unexpected backend fault")
        return super().load_response(response_id)


async def test_storage_an_unexpected_backend_fault_fails_that_request_and_nothing_is_lost(tmp_path: Path) -> None:
    faults = FaultCounter()
    backend = DamagedBackend(tmp_path, StorageLimits(max_bytes=1 << 20, max_entries=100, ttl_s=3600.0))
    with anyio.fail_after(TIMEOUT_S):
        async with run_actor(StorageActor(backend), faults=faults) as inbox:
            await call(inbox, lambda reply: SaveResponse(response=response("resp_kept"), reply=reply))
            with pytest.raises(Refused) as raised:
                await call(inbox, lambda reply: LoadResponse(response_id="resp_broken", reply=reply))
            kept = await call(inbox, lambda reply: LoadResponse(response_id="resp_kept", reply=reply))
    assert internal(raised) == INTERNAL
    assert faults.by_actor() == {"storage": 1}
    assert kept is not None and kept.id == "resp_kept"


async def test_compactor_a_malformed_count_fails_that_compaction_and_the_next_is_served() -> None:
    answers: list[Any] = [object()]  # the first count answer is malformed, the rest are not

    def count(message: TokenCounterMessage) -> Any:
        return answers.pop() if answers else TokenizeResult(tokens=(1,) * 50)

    counter: FakeNeighbour[TokenCounterMessage] = FakeNeighbour(count)
    ingress: FakeNeighbour[IngressMessage] = FakeNeighbour(
        lambda _: RequestFailed(kind=FailureKind.OVERLOADED, message="busy")
    )
    faults = FaultCounter()
    actor = CompactorActor(
        counter.send,
        ingress.send,
        CapsuleCodec(None, 1 << 20),
        CompactorLimits(context_length=4096, max_output_bytes=1 << 20, timeout_s=5.0),
        images=ImageAdmission(max_images=2, model_id="tiny", fetcher=None),
    )
    context = [
        {"id": f"msg_{n}", "type": "message", "role": role, "content": [{"type": "input_text", "text": f"{role} {n}"}]}
        for n, role in enumerate(["user", "assistant", "user", "assistant", "user"])
    ]
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tasks:
            await start_neighbours(tasks, counter, ingress)
            async with run_actor(actor, faults=faults) as inbox:
                with pytest.raises(Refused) as first:
                    await compact(inbox, context)
                with pytest.raises(Refused) as second:  # served: this time its summary is refused as overloaded
                    await compact(inbox, context)
            tasks.cancel_scope.cancel()
    assert internal(first) == INTERNAL
    assert faults.by_actor() == {"compactor": 1}
    assert second.value.failure.kind is FailureKind.OVERLOADED


async def compact(inbox: Any, context: list[dict[str, Any]]) -> Any:
    return await call(
        inbox,
        lambda reply: CompactHistory(
            context=context,
            request_items=context,
            instructions=None,
            tools=None,
            keep_tokens=10,
            max_output_tokens=16,
            session="s",
            reply=reply,
        ),
    )


class Invariant(Actor[StorageMessage]):
    """An actor whose every message breaks an invariant of the process."""

    name = "invariant"

    async def handle(self, message: StorageMessage) -> None:
        raise BrokenInvariant("the database is gone")


async def test_a_broken_invariant_still_stops_the_actor_loudly() -> None:
    send, receive = anyio.create_memory_object_stream[StorageMessage](4)
    reply_send, reply_receive = anyio.create_memory_object_stream[Any](1)
    with pytest.raises(BaseExceptionGroup) as stopped, anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tasks:
            await tasks.start(partial(Invariant().run, faults=FaultCounter()), receive)
            send.send_nowait(LoadResponse(response_id="x", reply=reply_send))
    send.close()
    with reply_receive, pytest.raises(anyio.EndOfStream):  # the asker's end: closed, never answered
        reply_receive.receive_nowait()
    assert stopped.group_contains(BrokenInvariant)
