"""The Quart app in-process, for states a live server passes through too quickly to test."""

from __future__ import annotations

import anyio
import pytest

from courier.conversation.capsule import CapsuleCodec
from courier.core.prompt_cache.stats import StoreCounters, StoreLimits, StoreStats
from courier.http.app import create_quart_app
from courier.http.context import AppContext, Outboxes
from courier.messages.compactor import CompactorMessage
from courier.messages.ingress import IngressMessage
from courier.messages.snapshot_store import ReadSnapshotStats, SnapshotStoreMessage
from courier.messages.storage import StorageMessage
from courier.messages.token_counter import TokenCounterMessage
from courier.model.info import ModelInfo
from courier.platform.blas import BlasReport
from courier.settings import Settings
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import Phase, ServiceState

BLAS = BlasReport(library="reference", path=None, optimized=False, detail="test")


@pytest.mark.anyio
@pytest.mark.parametrize(("phase", "code"), [(Phase.LOADING, "model_loading"), (Phase.DRAINING, "shutting_down")])
async def test_not_ready_answers_503_with_retry_after(phase: Phase, code: str) -> None:
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](1)
    ingress_send, ingress_receive = anyio.create_memory_object_stream[IngressMessage](1)
    storage_send, storage_receive = anyio.create_memory_object_stream[StorageMessage](1)
    compactor_send, compactor_receive = anyio.create_memory_object_stream[CompactorMessage](1)
    stats = SchedulerStats(max_batch=1, max_queue=1)
    state = ServiceState(blas=BLAS, model_id="m", scheduler=stats, phase=phase)
    outboxes = Outboxes(token_counter=send, ingress=ingress_send, storage=storage_send, compactor=compactor_send)
    context = AppContext(
        settings=Settings(),
        state=state,
        outboxes=outboxes,
        metrics=CourierMetrics(state),
        capsules=CapsuleCodec(None, Settings().max_body_bytes),
    )
    client = create_quart_app(context).test_client()
    health = await client.get("/health")
    assert health.status_code == 503
    assert (await health.get_json())["status"] == phase.value
    response = await client.post("/tokenize", json={"prompt": "hi"})
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    body = await response.get_json()
    assert body["error"]["code"] == code
    assert body["error"]["type"] == "server_error"
    with pytest.raises(anyio.WouldBlock):
        receive.receive_nowait()  # nothing was sent to the actor
    streams = (send, receive, ingress_send, ingress_receive, storage_send, storage_receive, compactor_send)
    for stream in (*streams, compactor_receive):
        stream.close()


@pytest.mark.anyio
async def test_cache_stats_count_no_warm_up_whose_snapshot_the_store_figures_miss() -> None:
    """A warm-up that ends while the store answers the stats (its insert queued behind that answer) is not counted
    as run next to figures that predate its snapshot: the scheduler's counters are read before the store is asked."""
    stats = SchedulerStats(max_batch=1, max_queue=1, warmups_queued=1, warmups_pending=1)
    model = ModelInfo(
        model_id="m",
        source="test",
        path="m",
        architecture="llama",
        context_length=None,
        device="cpu",
        weight_format="mlx",
        stored_format="mlx",
        prompt_cache_trimmable=True,
        created=0,
    )
    state = ServiceState(blas=BLAS, model_id="m", scheduler=stats, phase=Phase.READY, model=model)
    limits = StoreLimits(capacity_bytes=10**6, max_entries=10, ttl_s=60, min_prefix=8)
    send, receive = anyio.create_memory_object_stream[TokenCounterMessage](1)
    ingress_send, ingress_receive = anyio.create_memory_object_stream[IngressMessage](1)
    storage_send, storage_receive = anyio.create_memory_object_stream[StorageMessage](1)
    compactor_send, compactor_receive = anyio.create_memory_object_stream[CompactorMessage](1)
    store_send, store_receive = anyio.create_memory_object_stream[SnapshotStoreMessage](1)
    outboxes = Outboxes(
        token_counter=send,
        ingress=ingress_send,
        storage=storage_send,
        compactor=compactor_send,
        snapshot_store=store_send,
    )
    context = AppContext(
        settings=Settings(),
        state=state,
        outboxes=outboxes,
        metrics=CourierMetrics(state),
        capsules=CapsuleCodec(None, Settings().max_body_bytes),
    )

    async def store() -> None:
        message = await store_receive.receive()
        assert isinstance(message, ReadSnapshotStats)
        figures = StoreStats(entries=2, nbytes=200, limits=limits, counters=StoreCounters())  # before the warm-up's
        stats.warmups_run, stats.warmups_pending = 1, 0  # the warm-up ends; its snapshot waits behind this answer
        with message.reply:
            await message.reply.send(figures)

    async with anyio.create_task_group() as group:
        group.start_soon(store)
        response = await create_quart_app(context).test_client().get("/v1/cache/stats")
    shown = await response.get_json()
    # Not idle yet: the next poll, whose figures hold the warm-up's snapshot, is the first to say so.
    assert (shown["snapshot_entries"], shown["snapshot_warmups_run"], shown["snapshot_warmups_pending"]) == (2, 0, 1)
    streams = (send, receive, ingress_send, ingress_receive, storage_send, storage_receive, compactor_send, store_send)
    for stream in (*streams, compactor_receive, store_receive):
        stream.close()
