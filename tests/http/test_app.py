"""The Quart app in-process, for states a live server passes through too quickly to test."""

from __future__ import annotations

import anyio
import pytest

from courier.conversation.capsule import CapsuleCodec
from courier.http.app import create_quart_app
from courier.http.context import AppContext, Outboxes
from courier.messages.compactor import CompactorMessage
from courier.messages.ingress import IngressMessage
from courier.messages.storage import StorageMessage
from courier.messages.token_counter import TokenCounterMessage
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
