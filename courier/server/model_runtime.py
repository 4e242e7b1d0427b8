"""One model at work: loaded on the MLX thread, its actors started in dependency order, stopped in reverse.

`ModelRuntimes` is the model registry's loader (`actors/model_registry.py`): for one declared model it loads the
weights (converting a GGUF once), prepares its grammar compiler and starts its own media fetcher (a vision
model), token counter, snapshot store (its prompt cache), scheduler, ingress and compactor, each on a fresh inbox
in the supervisor's task group. Every model's engine runs on the one MLX thread (docs/architecture.md, "Several
models": the measured reasons). The running model is a `Runtime`; unloading it closes those inboxes dependants
first, writes what its prompt cache holds in memory to its disk tier (so a model loaded again finds its
conversations warm), releases the disk tier's directory and lets the weights go.

What the memory budget counts for a model (`charge_bytes`): its weights as loaded, room for
`KV_ALLOWANCE_TOKENS` tokens of live KV at the measured bytes per token, and its prompt cache's memory tier.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import mlx.core as mx
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream
from mlx.utils import tree_flatten

from courier.actors.compactor import CompactorActor, CompactorLimits
from courier.actors.ingress import IngressActor
from courier.actors.media_fetcher import MediaFetcherActor
from courier.actors.prompt_cache.snapshot_store import SnapshotStoreActor
from courier.actors.prompt_cache.store_link import PromptCaching
from courier.actors.scheduler import SchedulerActor
from courier.actors.token_counter import TokenCounterActor
from courier.conversation.capsule import CapsuleCodec
from courier.conversation.images import ImageAdmission
from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.sampling_defaults import resolve
from courier.core.step_planning.prompt_lookup import LookupLimits
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits
from courier.engine.prompt_cache.budget import available_memory, default_budget, measure_footprint
from courier.media.fetcher import FetchLimits, MediaFetcher
from courier.messages.model_registry import ModelOutboxes
from courier.messages.snapshot_store import FlushSnapshots
from courier.model.catalog import ModelDeclaration, check_files
from courier.model.embedding_models import EmbeddingModelError
from courier.model.loader import (
    LoadedModel,
    ModelLoadError,
    grammar_compiler,
    load_model,
    reasoning_format,
    tool_call_format,
)
from courier.model.progress import Progress, Step
from courier.runtime.actor import Actor, ActorBusy, ActorStopped, ask
from courier.runtime.faults import FaultCounter
from courier.runtime.message import Message
from courier.runtime.mlx_thread import MlxThread
from courier.server.batch_kv import batch_kv_quantization
from courier.server.embedding_runtime import as_embedding_model, start_embedding_model, start_pooled_embedder
from courier.server.prompt_cache import PromptCache, open_prompt_cache, snapshot_quantization
from courier.settings import Settings
from courier.status.models import ModelStatus

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

TOKEN_COUNTER_INBOX = 256
# Admissions beyond this many waiting for the ingress get a 503: far above --max-batch + --max-queue.
INGRESS_INBOX = 256
SCHEDULER_INBOX = 64
# Snapshot inserts beyond this many queued are dropped (counted), never waited for.
SNAPSHOT_STORE_INBOX = 256
COMPACTOR_INBOX = 64
MEDIA_INBOX = 64
PREFILL_BATCH = 8
# Live KV each loaded model is charged room for: two conversations of 4K tokens in flight.
KV_ALLOWANCE_TOKENS = 8192
# Writing an unloaded model's memory tier to its disk tier gets at most this long.
UNLOAD_FLUSH_S = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedServices:
    """What every model's actors share: the settings, the MLX thread, the task group they run in."""

    settings: Settings
    mlx: MlxThread
    task_group: TaskGroup
    faults: FaultCounter
    capsules: CapsuleCodec
    observe_time_to_first_token: Callable[[str], Callable[[float], None]]  # by model id
    snapshot_ceiling: int | None = None  # a model's prompt-cache memory tier at most (several models)


@dataclass(slots=True)
class _Started:
    outbox: MemoryObjectSendStream[Any]
    done: anyio.Event
    name: str


class Runtime:
    """A loaded model and its running actors (`messages/model_registry.ModelRuntime`)."""

    def __init__(self, model_id: str, services: SharedServices, status: ModelStatus) -> None:
        self.model_id = model_id
        self._services = services
        self._status = status
        self._started: list[_Started] = []
        self._cache: PromptCache | None = None
        self.loaded: LoadedModel | None = None
        self._outboxes: ModelOutboxes | None = None
        self.weights_bytes = 0
        self.charge_bytes = 0

    @property
    def outboxes(self) -> ModelOutboxes:
        assert self._outboxes is not None, "its actors have not started"
        return self._outboxes

    async def start(self, actor: Actor[M], capacity: int) -> MemoryObjectSendStream[M]:
        """Run `actor` on a fresh inbox in the shared task group, once it has set up."""
        send, receive = anyio.create_memory_object_stream[M](capacity)
        started = _Started(send, anyio.Event(), actor.name)
        faults = self._services.faults

        async def run(*, task_status: TaskStatus[None]) -> None:
            try:
                await actor.run(receive, task_status=task_status, faults=faults)
            finally:
                started.done.set()

        self._started.append(started)
        await self._services.task_group.start(run)
        return send

    async def unload(self) -> None:
        """Close the inboxes, dependants first (the scheduler fails what still runs); the prompt cache writes its
        memory tier to disk before its inbox closes; then the directory lock and the weights go."""
        for started in reversed(self._started):
            if started.name == SnapshotStoreActor.name and self._cache is not None and self._cache.disk is not None:
                await _flush(started.outbox, self.model_id)
            started.outbox.close()
            await started.done.wait()
        self._started.clear()
        if self._cache is not None and self._cache.disk is not None:
            self._cache.disk.directory.release()
        self._cache = None
        self.loaded = None
        self._status.state.mark_unloaded()
        await self._services.mlx.call(_free_memory)


class ModelRuntimes:
    """The model registry's loader. `pooling`: the generative models that also embed, by id (mean or last)."""

    def __init__(self, services: SharedServices, pooling: Mapping[str, str] | None = None) -> None:
        self._services = services
        self._pooling = dict(pooling or {})

    def check(self, declaration: ModelDeclaration) -> str | None:
        return check_files(declaration.source)

    async def load(self, declaration: ModelDeclaration, status: ModelStatus) -> Runtime:
        services, settings = self._services, self._services.settings
        runtime = Runtime(declaration.model_id, services, status)
        embedding = await as_embedding_model(declaration, status)
        if embedding is not None:
            return await _load_embedding_model(runtime, embedding, status)
        load = partial(
            load_model,
            declaration.source,
            served_model_name=declaration.model_id,
            cache_dir=settings.cache_dir,
            weight_format=settings.weight_format,
            first_pass=settings.warmup,
            progress=_ReportingProgress(status),
            trust_remote_code=settings.trust_remote_code,
        )
        loaded = await services.mlx.call(load)
        try:
            quantization = await snapshot_quantization(settings, loaded, services.mlx)
            kv_quantization = await batch_kv_quantization(settings, loaded, services.mlx)
            status.progress = "preparing constrained decoding"
            grammars = await anyio.to_thread.run_sync(grammar_compiler, loaded, settings.grammar_cache)
            status.progress = "starting its actors"
            runtime.loaded = loaded
            await _start_actors(runtime, loaded, grammars, quantization, kv_quantization)
            pooling = self._pooling.get(declaration.model_id)
            if pooling is not None:
                embedder = await start_pooled_embedder(runtime.start, services.mlx, loaded, pooling, status)
                runtime._outboxes = replace(runtime.outboxes, embedder=embedder)
            status.progress = "weighing it"
            runtime.weights_bytes, per_token = await services.mlx.call(partial(_weigh, loaded))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await runtime.unload()
            raise
        cache = runtime._cache.store.limits.capacity_bytes if runtime._cache is not None else 0
        runtime.charge_bytes = runtime.weights_bytes + per_token * KV_ALLOWANCE_TOKENS + cache
        info = loaded.info
        defaults = resolve(settings.default_temperature, settings.default_top_p, info.sampling)
        status.state.mark_ready(
            info, tool_call_format(loaded.tokenizer), grammars, defaults, reasoning=reasoning_format(loaded.tokenizer)
        )
        return runtime


async def _load_embedding_model(runtime: Runtime, declaration: ModelDeclaration, status: ModelStatus) -> Runtime:
    """An embedding model: its embedder alone, charged its weights."""
    try:
        embedder, weights = await start_embedding_model(runtime.start, runtime._services.mlx, declaration, status)
    except EmbeddingModelError as error:
        raise ModelLoadError(str(error)) from error
    except BaseException:
        with anyio.CancelScope(shield=True):
            await runtime.unload()
        raise
    runtime._outboxes = ModelOutboxes(embedder=embedder)
    runtime.weights_bytes = runtime.charge_bytes = weights
    return runtime


async def _start_actors(
    runtime: Runtime,
    loaded: LoadedModel,
    grammars: Any,
    quantization: KvQuantization | None,
    kv_quantization: KvQuantization | None = None,
) -> None:
    """In dependency order: the ingress needs the token counter and the scheduler."""
    services, settings = runtime._services, runtime._services.settings
    limits = BatchLimits(
        max_batch=settings.max_batch,
        prefill_batch=min(settings.max_batch, PREFILL_BATCH),
        prefill_step_size=settings.prefill_step_size,
        prefill_stall_s=settings.prefill_stall_ms / 1000,
        speculation=LookupLimits(settings.speculative_ngram, settings.speculative_tokens)
        if settings.speculation
        else None,
        snapshot_quantization=quantization,
        kv_quantization=kv_quantization,
    )
    vision = loaded.vision
    media = await runtime.start(_media_fetcher(settings), MEDIA_INBOX) if vision is not None else None
    images = ImageAdmission(max_images=settings.max_images, model_id=loaded.info.model_id, fetcher=media)
    token_counter = await runtime.start(
        TokenCounterActor(
            loaded.tokenizer,
            vision.processor if vision is not None else None,
            normalize=settings.prompt_cache_normalize,
            remember_renders=settings.prompt_cache,
            stats=runtime._status.state.tokenizer,
        ),
        TOKEN_COUNTER_INBOX,
    )
    caching = await _start_snapshot_store(runtime, loaded, quantization) if settings.prompt_cache else None
    scheduler = SchedulerActor(
        services.mlx,
        lambda: BatchEngine(
            loaded.model, loaded.tokenizer, limits, vision.embedder if vision else None, grammars=grammars
        ),
        runtime._status.state.scheduler,
        admission_window_s=settings.admission_window_ms / 1000,
        caching=caching,
        observe_time_to_first_token=services.observe_time_to_first_token(runtime.model_id),
    )
    scheduler_send = await runtime.start(scheduler, SCHEDULER_INBOX)
    reasoning = reasoning_format(loaded.tokenizer)
    ingress = await runtime.start(
        IngressActor(
            token_counter,
            scheduler_send,
            context_length=loaded.info.usable_context_length,
            vocabulary_size=len(loaded.tokenizer.get_vocab()),
            images=images,
            scheduler_stats=runtime._status.state.scheduler,
            stats=runtime._status.state.admission,
            reasoning=reasoning,
            default_max_tokens=settings.default_max_tokens,
        ),
        INGRESS_INBOX,
    )
    compactor_limits = CompactorLimits(
        context_length=loaded.info.usable_context_length,
        max_output_bytes=settings.max_body_bytes,
        timeout_s=settings.request_timeout,
    )
    compactor = await runtime.start(
        CompactorActor(
            token_counter,
            ingress,
            services.capsules,
            compactor_limits,
            images=images,
            reasoning=reasoning,
            grammars=grammars,
        ),
        COMPACTOR_INBOX,
    )
    runtime._outboxes = ModelOutboxes(
        token_counter=token_counter,
        ingress=ingress,
        compactor=compactor,
        snapshot_store=caching.store if caching is not None else None,
        media_fetcher=media,
    )


async def _start_snapshot_store(
    runtime: Runtime, loaded: LoadedModel, quantization: KvQuantization | None
) -> PromptCaching:
    services = runtime._services
    settings = services.settings
    if services.snapshot_ceiling is not None and settings.prompt_cache_snapshot_capacity_bytes is None:
        footprint = await services.mlx.call(partial(measure_footprint, loaded.model))
        budget = default_budget(footprint, available_memory())
        capacity = min(budget.capacity_bytes, services.snapshot_ceiling)
        logger.info(
            "model %s: prompt cache memory tier %d bytes (%s; at most %d, a share of the models' memory budget)",
            runtime.model_id,
            capacity,
            budget.explanation,
            services.snapshot_ceiling,
        )
        settings = replace(settings, prompt_cache_snapshot_capacity_bytes=capacity)
    cache = await open_prompt_cache(settings, loaded, services.mlx, quantization)
    runtime._cache = cache
    tokenizer = loaded.tokenizer
    actor = SnapshotStoreActor(cache.store, cache.disk, decode=lambda tokens: str(tokenizer.decode(list(tokens))))
    store = await runtime.start(actor, SNAPSHOT_STORE_INBOX)
    return PromptCaching(store=store, bucket=cache.bucket)


def _media_fetcher(settings: Settings) -> MediaFetcherActor:
    """A vision model's images are read by the media fetcher, under the address policy and the limits."""
    if settings.allow_private_media_urls:
        logger.warning(
            "WARNING: --allow-private-media-urls is set: image URLs may reach loopback, private, link-local "
            "(cloud metadata) and other non-public addresses. Use it only on a machine no untrusted client "
            "can reach."
        )
    limits = FetchLimits(
        max_bytes=settings.max_image_bytes,
        max_pixels=settings.max_image_pixels,
        media_root=settings.media_path,
        allow_private=settings.allow_private_media_urls,
        max_image_memory_bytes=settings.max_image_memory_bytes,
        memory_wait_s=settings.request_timeout,  # a request waits for image memory at most its deadline
    )
    return MediaFetcherActor(MediaFetcher(limits))


async def _flush(outbox: MemoryObjectSendStream[Any], model_id: str) -> None:
    """What the memory tier holds, written to the disk tier before the model goes."""
    written: Any = None
    with anyio.move_on_after(UNLOAD_FLUSH_S), suppress(ActorBusy, ActorStopped):
        written = await ask(outbox, lambda reply: FlushSnapshots(reply=reply))
    if isinstance(written, int):
        logger.info("model %s: %d prompt-cache snapshots written to disk for its next load", model_id, written)
    else:
        logger.warning("model %s: could not write its prompt cache's memory tier to disk", model_id)


def _weigh(loaded: LoadedModel) -> tuple[int, int]:
    """On the MLX thread: the weights' bytes, and the live KV's bytes per token."""
    weights = sum(array.nbytes for _, array in tree_flatten(loaded.model.parameters()))
    return weights, measure_footprint(loaded.model).per_token_bytes


def _free_memory() -> None:
    """On the MLX thread, once nothing refers to the model: its buffers back to the system."""
    gc.collect()
    mx.clear_cache()


class _ReportingProgress(Progress):
    """The loader's progress on stderr, and its current step in the model's status (`/health`)."""

    def __init__(self, status: ModelStatus) -> None:
        super().__init__()
        self._status = status

    @contextmanager
    def step(self, title: str, total: int | None = None) -> Iterator[Step]:
        self._status.progress = title  # written from the MLX thread: one attribute, read by /health
        with super().step(title, total) as step:
            yield step
