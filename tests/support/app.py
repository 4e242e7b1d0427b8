"""The Quart app in-process, ready, with no actor behind it: for tables of requests the HTTP layer refuses itself.

A refusal decided while the body is read and validated needs no model, no actor and no server process: such a table
runs here in milliseconds a case instead of through a `courier serve` subprocess. Nothing reads the actors' inboxes
(they are closed), so a request that gets past validation is answered 503 at once, and a table case that needs an
actor fails loudly instead of passing for the wrong reason. A few cases of each table still go through a real server
(its module's tests), which shows the two answer alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from quart.typing import TestClientProtocol as QuartClient

from courier.conversation.capsule import CapsuleCodec
from courier.http.app import create_quart_app
from courier.http.auth import ApiKeys
from courier.http.context import AppContext, Outboxes
from courier.model.info import ModelInfo
from courier.platform.blas import BlasReport
from courier.settings import Settings
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import Phase, ServiceState

BLAS = BlasReport(library="reference", path=None, optimized=False, detail="test")
TINY_LLAMA_CONTEXT = 2048  # tests/support/tiny_models.py's max_position_embeddings


@contextmanager
def validating_app(model_id: str, settings: Settings | None = None) -> Iterator[QuartClient]:
    """A test client of the app serving `model_id` (a text-only llama with the tiny llama's context), ready."""
    with ready_context(model_id, settings) as context:
        yield create_quart_app(context).test_client()


@contextmanager
def ready_context(
    model_id: str, settings: Settings | None = None, api_keys: ApiKeys | None = None
) -> Iterator[AppContext]:
    """The context of an app serving `model_id` (a text-only llama with the tiny llama's context), ready, with no
    actor behind it (see the module's docstring)."""
    settings = settings or Settings()
    model = ModelInfo(
        model_id=model_id,
        source="test",
        path=model_id,
        architecture="llama",
        context_length=TINY_LLAMA_CONTEXT,
        device="cpu",
        weight_format="float32",
        stored_format="mlx",
        prompt_cache_trimmable=True,
        created=0,
    )
    stats = SchedulerStats(max_batch=settings.max_batch, max_queue=settings.max_queue)
    state = ServiceState(blas=BLAS, model_id=model_id, scheduler=stats, phase=Phase.READY, model=model)
    streams = [anyio.create_memory_object_stream[Any](1) for _ in range(5)]
    for _, receive in streams:
        receive.close()  # no actor runs here: a request that asks one is answered 503 at once
    outboxes = Outboxes(
        token_counter=streams[0][0],
        ingress=streams[1][0],
        storage=streams[2][0],
        compactor=streams[3][0],
        snapshot_store=streams[4][0],
    )
    context = AppContext(
        settings=settings,
        state=state,
        outboxes=outboxes,
        metrics=CourierMetrics(state),
        capsules=CapsuleCodec(None, settings.max_body_bytes),
        api_keys=api_keys or ApiKeys(()),
    )
    try:
        yield context
    finally:
        for send, _ in streams:
            send.close()
