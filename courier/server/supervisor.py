"""The supervisor: owns the root task group, starts everything in order, drains on a signal.

Start-up: tracing, the HTTP server (so `/health` answers 503 while loading), the
model on the MLX thread, then each actor with `task_group.start` in dependency
order (the token counter needs the tokenizer), then READY.

Shutdown on SIGINT/SIGTERM (RUNNING -> DRAINING -> STOPPED): new requests get a
503, Hypercorn stops accepting and in-flight requests get `--shutdown-timeout`
seconds to finish. Then actor inboxes are closed, dependants first, so each actor
answers what is queued and ends; the scheduler fails the generations still
running, whose clients get an error event; after a short flush everything left
is cancelled. A second signal cancels at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from collections.abc import Mapping
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from courier.actors.compactor import CompactorActor, CompactorLimits
from courier.actors.ingress import IngressActor
from courier.actors.media_fetcher import MediaFetcherActor
from courier.actors.scheduler import PromptCaching, SchedulerActor
from courier.actors.snapshot_store import SnapshotStoreActor
from courier.actors.storage import StorageActor
from courier.actors.token_counter import TokenCounterActor
from courier.conversation.capsule import CapsuleCodec
from courier.conversation.images import ImageAdmission
from courier.core.model_names import ServedNames
from courier.core.prompt_lookup import LookupLimits
from courier.core.sampling_defaults import resolve
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits
from courier.grammar.compiler import GrammarCompiler
from courier.http.app import create_app
from courier.http.auth import ApiKeys
from courier.http.context import AppContext, Outboxes
from courier.media.fetcher import FetchLimits, MediaFetcher
from courier.messages.base import RequestFailed
from courier.messages.compactor import CompactorMessage
from courier.messages.ingress import IngressMessage
from courier.messages.media import MediaFetcherMessage
from courier.messages.scheduler import SchedulerMessage
from courier.messages.snapshot_store import FlushSnapshots, SnapshotStoreMessage
from courier.messages.storage import StorageMessage
from courier.messages.token_counter import TokenCounterMessage
from courier.model.loader import (
    LoadedModel,
    ModelLoadError,
    grammar_compiler,
    load_model,
    reasoning_format,
    tool_call_format,
)
from courier.model.progress import Progress
from courier.model.source import ModelSource
from courier.platform.blas import BlasReport
from courier.platform.mlx_memory import limit_cache
from courier.runtime.actor import Actor, ActorBusy, ActorStopped, ask
from courier.runtime.message import Message
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import configure_tracing
from courier.server.client_watch import ClientGoneMiddleware, ConnectionWatch
from courier.server.connection_cap import cap_for_open_files, install_connection_cap
from courier.server.errors import ServerFailed
from courier.server.keys import load_api_keys, load_capsule_codec, load_reasoning_seal
from courier.server.prompt_cache import open_prompt_cache
from courier.server.response_store import StoreNotOpened, open_response_store
from courier.settings import Settings
from courier.status.connections import ConnectionStats
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState
from courier.storage.records import StorageLimits
from courier.storage.tenancy import shared_limits

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

TOKEN_COUNTER_INBOX = 256
# Admissions beyond this many waiting for the ingress get a 503: far above --max-batch + --max-queue.
INGRESS_INBOX = 256
SCHEDULER_INBOX = 64
# Snapshot inserts beyond this many queued are dropped (counted), never waited for.
SNAPSHOT_STORE_INBOX = 256
STORAGE_INBOX = 256
# After in-flight HTTP requests are done or timed out, actors get this long to finish.
ACTOR_STOP_GRACE_S = 5.0
MLX_THREAD_JOIN_S = 2.0
# The prompt cache's flush to disk at a clean stop gets what --shutdown-timeout leaves, but at least this.
MIN_FLUSH_S = 1.0
# After failing in-flight requests at the drain deadline, how long their responses get to reach the clients.
ERROR_FLUSH_S = 2.0
PREFILL_BATCH = 8
COMPACTOR_INBOX = 64
MEDIA_INBOX = 64


class Supervisor:
    def __init__(self, settings: Settings, source: ModelSource, blas: BlasReport, environ: Mapping[str, str]) -> None:
        self._settings = settings
        self._source = source
        self._environ = environ
        self._stop = anyio.Event()
        self._failure: str | None = None
        self._forced = False
        self._mlx = MlxThread()
        # Each started actor's inbox (send side) and an event set when it has ended, in start order.
        self._started_actors: list[tuple[MemoryObjectSendStream[Any], anyio.Event]] = []
        self._token_counter_send, self._token_counter_receive = anyio.create_memory_object_stream[TokenCounterMessage](
            TOKEN_COUNTER_INBOX
        )
        self._scheduler_send, self._scheduler_receive = anyio.create_memory_object_stream[SchedulerMessage](
            SCHEDULER_INBOX
        )
        self._ingress_send, self._ingress_receive = anyio.create_memory_object_stream[IngressMessage](INGRESS_INBOX)
        self._snapshots_send, self._snapshots_receive = anyio.create_memory_object_stream[SnapshotStoreMessage](
            SNAPSHOT_STORE_INBOX
        )
        self._storage_send, self._storage_receive = anyio.create_memory_object_stream[StorageMessage](STORAGE_INBOX)
        self._compactor_send, self._compactor_receive = anyio.create_memory_object_stream[CompactorMessage](
            COMPACTOR_INBOX
        )
        self._media_send, self._media_receive = anyio.create_memory_object_stream[MediaFetcherMessage](MEDIA_INBOX)
        self._capsules = CapsuleCodec(None, settings.max_body_bytes)
        stats = SchedulerStats(max_batch=settings.max_batch, max_queue=settings.max_queue)
        self._state = ServiceState(
            blas=blas,
            model_id=ServedNames.parse(settings.served_model_name, source.default_id).model_id,
            scheduler=stats,
            connections=ConnectionStats(limit=cap_for_open_files(settings.max_connections)),
        )
        self._api_keys = ApiKeys(())
        self._metrics = CourierMetrics(self._state)
        self._snapshot_disk = False  # whether the prompt cache has a disk tier to flush at a clean stop

    async def run(self) -> None:
        self._capsules = load_capsule_codec(self._settings)
        self._api_keys = load_api_keys(self._settings)
        provider = configure_tracing(self._environ, self._settings.trace_file)
        listener = bind_listener(self._settings.host, self._settings.port)
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._watch_signals, task_group)
                http_done = anyio.Event()
                await task_group.start(self._serve_http, listener, http_done)
                task_group.start_soon(self._load_and_start_actors, task_group)
                await self._stop.wait()
                await self._drain(task_group, http_done)
        finally:
            for inbox in (
                self._token_counter_receive,
                self._scheduler_receive,
                self._ingress_receive,
                self._snapshots_receive,
                self._storage_receive,
                self._compactor_receive,
                self._media_receive,
            ):
                inbox.close()
            self._mlx.close(MLX_THREAD_JOIN_S)
            provider.shutdown()
        if self._failure is not None:
            raise ServerFailed(self._failure)

    async def _serve_http(
        self, listener: socket.socket, http_done: anyio.Event, *, task_status: TaskStatus[None]
    ) -> None:
        context = AppContext(
            settings=self._settings,
            state=self._state,
            metrics=self._metrics,
            capsules=self._capsules,
            seal=load_reasoning_seal(self._settings),
            api_keys=self._api_keys,
            outboxes=Outboxes(
                token_counter=self._token_counter_send,
                ingress=self._ingress_send,
                storage=self._storage_send,
                compactor=self._compactor_send,
                snapshot_store=self._snapshots_send if self._settings.prompt_cache else None,
                media_fetcher=self._media_send,
            ),
        )
        config = HypercornConfig()
        host, port = listener.getsockname()[:2]
        config.bind = [f"fd://{listener.detach()}"]
        # Hypercorn waits a little longer than the drain deadline, so requests failed at the deadline can still
        # send their error to the client.
        config.graceful_timeout = self._settings.shutdown_timeout + ERROR_FLUSH_S
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        logger.info("listening on http://%s:%d (model %s loading)", _url_host(host), port, self._state.model_id)
        task_status.started()
        watch = ConnectionWatch()
        uninstall_cap = install_connection_cap(self._state.connections, watch)
        app = ClientGoneMiddleware(create_app(context), watch, self._state.connections)
        try:
            await hypercorn_serve(app, config, shutdown_trigger=self._stop.wait, mode="asgi")  # type: ignore[arg-type]
        except Exception:
            # Hypercorn cancelled in the middle of its own graceful shutdown (a second signal) fails with
            # asyncio.InvalidStateError; the process is stopping on purpose, so that is not worth a traceback.
            if not self._forced:
                raise
        finally:
            uninstall_cap()
            http_done.set()

    async def _load_and_start_actors(self, task_group: TaskGroup) -> None:
        if not await self._start_storage(task_group):
            return
        progress = Progress()
        load = partial(
            load_model,
            self._source,
            served_model_name=ServedNames.parse(self._settings.served_model_name, self._source.default_id).model_id,
            cache_dir=self._settings.cache_dir,
            weight_format=self._settings.weight_format,
            warmup=self._settings.warmup,
            progress=progress,
            trust_remote_code=self._settings.trust_remote_code,
        )
        await self._mlx.call(partial(limit_cache, self._settings.mlx_cache_limit))
        try:
            loaded = await self._mlx.call(load)
        except ModelLoadError as error:
            logger.error("%s", error)
            self._failure = str(error)
            self._stop.set()
            return
        grammars = await anyio.to_thread.run_sync(grammar_compiler, loaded, self._settings.grammar_cache)
        await self._start_actors(task_group, loaded, grammars)
        info = loaded.info
        defaults = resolve(self._settings.default_temperature, self._settings.default_top_p, info.sampling)
        self._state.mark_ready(
            info, tool_call_format(loaded.tokenizer), grammars, defaults, reasoning=reasoning_format(loaded.tokenizer)
        )
        logger.info(
            "ready: model %s (%s) on %s, weights %s, BLAS %s, context %s tokens",
            info.model_id,
            info.architecture,
            info.device,
            info.weight_format,
            self._state.blas.library,
            info.context_length,
        )

    async def _start_storage(self, task_group: TaskGroup) -> bool:
        """Stored responses and conversations need no model: they are served while it loads."""
        settings = self._settings
        store = StorageLimits(
            max_bytes=settings.storage_max_bytes, max_entries=settings.storage_max_entries, ttl_s=settings.storage_ttl
        )
        # Each API key's share: no key can evict what another stored.
        limits = shared_limits(
            store, len(self._api_keys), settings.storage_tenant_max_bytes, settings.storage_tenant_max_entries
        )
        try:
            opened = await anyio.to_thread.run_sync(open_response_store, settings, limits)
        except StoreNotOpened as error:
            self._failure = str(error)
            logger.error("%s", self._failure)
            self._stop.set()
            return False
        if opened.unreachable is not None:
            logger.warning(
                "response store %s cannot be reached (%s); starting without it and retrying: requests that need "
                "storage get 503 storage_unavailable until it answers, everything else is served",
                opened.location,
                opened.unreachable,
            )
        else:
            logger.info(
                "response store %s: %d records, %d bytes (budget %d bytes, %d records, TTL %.0f s; each API key "
                "%d bytes, %d records)",
                opened.location,
                opened.entries,
                opened.nbytes,
                limits.max_bytes,
                limits.max_entries,
                limits.ttl_s,
                limits.tenant_bytes,
                limits.tenant_entries,
            )
        await task_group.start(
            self._run_actor,
            StorageActor(opened.storage, self._state.storage_faults),
            self._storage_receive,
            self._storage_send,
        )
        return True

    async def _start_actors(self, task_group: TaskGroup, loaded: LoadedModel, grammars: GrammarCompiler | None) -> None:
        """In dependency order: the ingress needs the token counter and the scheduler."""
        settings = self._settings
        limits = BatchLimits(
            max_batch=settings.max_batch,
            prefill_batch=min(settings.max_batch, PREFILL_BATCH),
            prefill_step_size=settings.prefill_step_size,
            prefill_stall_s=settings.prefill_stall_ms / 1000,
            speculation=LookupLimits(settings.speculative_ngram, settings.speculative_tokens)
            if settings.speculation
            else None,
        )
        vision = loaded.vision
        media_fetcher = await self._start_media_fetcher(task_group) if vision is not None else None
        images = ImageAdmission(max_images=settings.max_images, model_id=loaded.info.model_id, fetcher=media_fetcher)
        token_counter = TokenCounterActor(
            loaded.tokenizer,
            vision.processor if vision is not None else None,
            normalize=settings.prompt_cache_normalize,
        )
        await task_group.start(self._run_actor, token_counter, self._token_counter_receive, self._token_counter_send)
        caching = await self._start_snapshot_store(task_group, loaded) if settings.prompt_cache else None
        scheduler = SchedulerActor(
            self._mlx,
            lambda: BatchEngine(
                loaded.model, loaded.tokenizer, limits, vision.embedder if vision else None, grammars=grammars
            ),
            self._state.scheduler,
            admission_window_s=settings.admission_window_ms / 1000,
            caching=caching,
            observe_time_to_first_token=self._metrics.time_to_first_token.observe,
        )
        await task_group.start(self._run_actor, scheduler, self._scheduler_receive, self._scheduler_send)
        ingress = IngressActor(
            self._token_counter_send,
            self._scheduler_send,
            context_length=loaded.info.usable_context_length,
            vocabulary_size=len(loaded.tokenizer.get_vocab()),
            images=images,
            scheduler_stats=self._state.scheduler,
            stats=self._state.admission,
            reasoning=reasoning_format(loaded.tokenizer),
            default_max_tokens=self._settings.default_max_tokens,
        )
        await task_group.start(self._run_actor, ingress, self._ingress_receive, self._ingress_send)
        compactor = CompactorActor(
            self._token_counter_send,
            self._ingress_send,
            self._capsules,
            CompactorLimits(
                context_length=loaded.info.usable_context_length,
                max_output_bytes=settings.max_body_bytes,
                timeout_s=settings.request_timeout,
            ),
            images=images,
            reasoning=reasoning_format(loaded.tokenizer),
            grammars=grammars,
        )
        await task_group.start(self._run_actor, compactor, self._compactor_receive, self._compactor_send)

    async def _start_media_fetcher(self, task_group: TaskGroup) -> MemoryObjectSendStream[MediaFetcherMessage]:
        """A vision model's images are read by the media fetcher, under the address policy and the limits."""
        settings = self._settings
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
        actor = MediaFetcherActor(MediaFetcher(limits))
        await task_group.start(self._run_actor, actor, self._media_receive, self._media_send)
        return self._media_send

    async def _start_snapshot_store(self, task_group: TaskGroup, loaded: LoadedModel) -> PromptCaching:
        cache = await open_prompt_cache(self._settings, loaded, self._mlx)
        self._snapshot_disk = cache.disk is not None
        tokenizer = loaded.tokenizer
        actor = SnapshotStoreActor(cache.store, cache.disk, decode=lambda tokens: str(tokenizer.decode(list(tokens))))
        await task_group.start(self._run_actor, actor, self._snapshots_receive, self._snapshots_send)
        return PromptCaching(store=self._snapshots_send, bucket=cache.bucket)

    async def _run_actor(
        self,
        actor: Actor[M],
        inbox: MemoryObjectReceiveStream[M],
        outbox: MemoryObjectSendStream[M],
        *,
        task_status: TaskStatus[None],
    ) -> None:
        done = anyio.Event()
        self._started_actors.append((outbox, done))
        try:
            await actor.run(inbox, task_status=task_status, faults=self._state.faults)
        finally:
            done.set()

    async def _drain(self, task_group: TaskGroup, http_done: anyio.Event) -> None:
        self._state.mark_draining()
        logger.info("draining: finishing in-flight requests (up to %.0f s)", self._settings.shutdown_timeout)
        deadline = time.monotonic() + self._settings.shutdown_timeout
        with anyio.move_on_after(self._settings.shutdown_timeout):
            await http_done.wait()
        flush_s = max(deadline - time.monotonic(), MIN_FLUSH_S)
        # Past the deadline, or with nothing left in flight: close the inboxes, dependants first. Each actor answers
        # what is queued and ends; the scheduler fails what still runs, so open streams get a clear error event. The
        # snapshot store flushes to disk once the scheduler has ended: no insert (a last warm-up) can follow it.
        with anyio.move_on_after(ACTOR_STOP_GRACE_S + flush_s):
            for outbox, done in reversed(self._started_actors):
                if outbox is self._snapshots_send:
                    await self._flush_snapshots(flush_s)
                outbox.close()
                await done.wait()
        for outbox in (
            self._compactor_send,
            self._ingress_send,
            self._media_send,
            self._scheduler_send,
            self._snapshots_send,
            self._token_counter_send,
            self._storage_send,
        ):
            outbox.close()
        with anyio.move_on_after(ERROR_FLUSH_S):
            await http_done.wait()
        task_group.cancel_scope.cancel()
        logger.info("stopped")

    async def _flush_snapshots(self, budget_s: float) -> None:
        """Write the conversations memory holds to the prompt cache's disk tier, so a restart keeps them warm."""
        if not self._snapshot_disk:
            return
        written: int | RequestFailed | None = None
        with anyio.move_on_after(budget_s):
            with suppress(ActorBusy, ActorStopped):
                written = await ask(self._snapshots_send, lambda reply: FlushSnapshots(reply=reply))
        if isinstance(written, int):
            logger.info("prompt cache: %d snapshots written to disk for the next start", written)
        else:
            logger.warning("prompt cache: could not flush the memory tier to disk within %.1f s", budget_s)

    async def _watch_signals(self, task_group: TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for received in signals:
                if self._stop.is_set():
                    logger.warning("second %s: stopping now", signal.Signals(received).name)
                    self._forced = True
                    task_group.cancel_scope.cancel()
                    return
                logger.info("received %s: shutting down", signal.Signals(received).name)
                self._stop.set()


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind and listen before Hypercorn starts, so port 0 resolves and no request is refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((host, port))
    except OSError:
        listener.close()
        raise
    listener.listen(socket.SOMAXCONN)
    return listener


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
