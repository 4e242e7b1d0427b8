"""The supervisor: owns the root task group, starts everything in order, drains on a signal.

Start-up: tracing, the HTTP server (so `/health` answers 503 while loading), storage, then the model registry
(`actors/model_registry.py`), which loads the default model (and any `--pin`ned one) through the per-model
runtimes (`server/model_runtime.py`): each loaded model has its own token counter, snapshot store, scheduler,
ingress and compactor, all on the one MLX thread. With one model, a failure to load it stops the server, as it
always did; with several, it is logged and the others are served (it is tried again when asked for).

Shutdown on SIGINT/SIGTERM (RUNNING -> DRAINING -> STOPPED): new requests get a
503, Hypercorn stops accepting and in-flight requests get `--shutdown-timeout`
seconds to finish. Then every model is unloaded (its actors' inboxes closed,
dependants first, so each answers what is queued and ends; its scheduler fails the
generations still running, whose clients get an error event; its prompt cache's
memory tier written to disk), then storage; after a short flush everything left
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

from courier.actors.model_registry import ModelRegistryActor, ResidencyLimits
from courier.actors.storage import StorageActor
from courier.conversation.capsule import CapsuleCodec
from courier.http.access_log import log_refused_connection
from courier.http.app import create_app
from courier.http.auth import ApiKeys
from courier.http.context import AppContext, Outboxes
from courier.messages.asking import Refused, call
from courier.messages.base import RequestFailed
from courier.messages.model_registry import LoadModel, LoadResult, ModelRegistryMessage, UnloadAll
from courier.messages.storage import StorageMessage
from courier.model.catalog import ModelCatalog
from courier.platform.blas import BlasReport
from courier.platform.cpu_attention import CpuAttention
from courier.platform.mlx_memory import limit_cache
from courier.runtime.actor import Actor
from courier.runtime.message import Message, ReplyStream
from courier.runtime.mlx_thread import MlxThread
from courier.runtime.tracing import configure_tracing
from courier.server.client_watch import ClientGoneMiddleware, ConnectionWatch
from courier.server.connection_cap import cap_for_open_files, install_connection_cap
from courier.server.errors import ServerFailed
from courier.server.keys import load_api_keys, load_capsule_codec, load_reasoning_seal
from courier.server.model_budget import memory_budget, model_statuses, snapshot_ceiling
from courier.server.model_runtime import ModelRuntimes, SharedServices
from courier.server.response_store import StoreNotOpened, open_response_store
from courier.settings import Settings
from courier.status.connections import ConnectionStats
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState
from courier.storage.records import StorageLimits
from courier.storage.tenancy import oversubscribed, shared_limits

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

STORAGE_INBOX = 256
# Requests for models beyond this many waiting for the registry get a 503; each is answered at once or parked.
REGISTRY_INBOX = 256
# After in-flight HTTP requests are done or timed out, actors get this long to finish.
ACTOR_STOP_GRACE_S = 5.0
MLX_THREAD_JOIN_S = 2.0
# The prompt cache's flush to disk at a clean stop gets what --shutdown-timeout leaves, but at least this.
MIN_FLUSH_S = 1.0
# After failing in-flight requests at the drain deadline, how long their responses get to reach the clients.
ERROR_FLUSH_S = 2.0


class Supervisor:
    def __init__(
        self,
        settings: Settings,
        catalog: ModelCatalog,
        blas: BlasReport,
        environ: Mapping[str, str],
        *,
        cpu_attention: CpuAttention | None = None,
    ) -> None:
        self._settings = settings
        self._catalog = catalog
        self._environ = environ
        self._stop = anyio.Event()
        self._failure: str | None = None
        self._forced = False
        self._mlx = MlxThread()
        # Each started actor's inbox (send side) and an event set when it has ended, in start order.
        self._started_actors: list[tuple[MemoryObjectSendStream[Any], anyio.Event]] = []
        self._storage_send, self._storage_receive = anyio.create_memory_object_stream[StorageMessage](STORAGE_INBOX)
        self._registry_send, self._registry_receive = anyio.create_memory_object_stream[ModelRegistryMessage](
            REGISTRY_INBOX
        )
        self._capsules = CapsuleCodec(None, settings.max_body_bytes)
        stats = SchedulerStats(max_batch=settings.max_batch, max_queue=settings.max_queue)
        self._state = ServiceState(
            blas=blas,
            cpu_attention=cpu_attention,
            model_id=catalog.default.model_id,
            scheduler=stats,
            connections=ConnectionStats(limit=cap_for_open_files(settings.max_connections)),
        )
        self._budget = memory_budget(settings)
        self._models = model_statuses(catalog, settings, self._state, self._budget)
        self._api_keys = ApiKeys(())
        self._metrics = CourierMetrics(self._state, self._models)

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
                task_group.start_soon(self._start_serving, task_group)
                await self._stop.wait()
                await self._drain(task_group, http_done)
        finally:
            for inbox in (self._storage_receive, self._registry_receive):
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
            outboxes=_unbound_outboxes(self._storage_send),
            registry=self._registry_send,
            models=self._models,
        )
        config = HypercornConfig()
        host, port = listener.getsockname()[:2]
        config.bind = [f"fd://{listener.detach()}"]
        # Hypercorn waits a little longer than the drain deadline, so requests failed at the deadline can still
        # send their error to the client.
        config.graceful_timeout = self._settings.shutdown_timeout + ERROR_FLUSH_S
        config.keep_alive_timeout = self._settings.keep_alive_timeout
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        logger.info("listening on http://%s:%d (model %s loading)", _url_host(host), port, self._state.model_id)
        task_status.started()
        watch = ConnectionWatch()
        refused = log_refused_connection if self._settings.access_log else None
        uninstall_cap = install_connection_cap(self._state.connections, watch, refused)
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

    async def _start_serving(self, task_group: TaskGroup) -> None:
        if not await self._start_storage(task_group):
            return
        await self._mlx.call(lambda: limit_cache(self._settings.mlx_cache_limit))
        await self._start_registry(task_group)
        logger.info(
            "models' memory budget %d bytes (%s)%s",
            self._budget.bytes,
            self._budget.explanation,
            f", at most {self._settings.max_loaded_models} loaded" if self._settings.max_loaded_models else "",
        )
        default = self._catalog.default.model_id
        preload = [default, *(m.model_id for m in self._catalog.models[1:] if self._models.models[m.model_id].pinned)]
        for model_id in preload:
            try:
                await call(self._registry_send, partial(_load, model_id))
            except Refused as refused:
                if not self._catalog.several:
                    self._failure = refused.failure.message.removeprefix(f"the model '{default}' could not be loaded: ")
                    logger.error("%s", self._failure)
                    self._stop.set()
                    return
        if not self._stop.is_set():
            self._state.mark_serving()
            self._log_ready()

    def _log_ready(self) -> None:
        info = self._state.model
        if not self._catalog.several and info is not None:
            logger.info(
                "ready: model %s (%s) on %s, weights %s, BLAS %s, context %s tokens",
                info.model_id,
                info.architecture,
                info.device,
                info.weight_format,
                self._state.blas.library,
                info.context_length,
            )
            return
        shown = ", ".join(f"{model_id} ({model.residency.value})" for model_id, model in self._models.models.items())
        logger.info("ready: %d models: %s; BLAS %s", len(self._models.models), shown, self._state.blas.library)

    async def _start_registry(self, task_group: TaskGroup) -> None:
        observe = self._metrics.observe_time_to_first_token
        services = SharedServices(
            settings=self._settings,
            mlx=self._mlx,
            task_group=task_group,
            faults=self._state.faults,
            capsules=self._capsules,
            observe_time_to_first_token=observe,
            snapshot_ceiling=snapshot_ceiling(self._catalog, self._settings, self._budget),
        )
        limits = ResidencyLimits(
            budget_bytes=self._budget.bytes, max_loaded=self._settings.max_loaded_models, ttl_s=self._settings.model_ttl
        )
        registry = ModelRegistryActor(
            self._catalog,
            self._models,
            ModelRuntimes(services, self._catalog.pooling(self._settings.embedding_pooling)),
            limits,
            self._registry_send.clone(),
        )
        await task_group.start(self._run_actor, registry, self._registry_receive, self._registry_send)

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
        if warning := oversubscribed(limits, len(self._api_keys)):
            logger.warning("%s", warning)
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
        for model in self._models.models.values():
            model.state.mark_draining()
        logger.info("draining: finishing in-flight requests (up to %.0f s)", self._settings.shutdown_timeout)
        deadline = time.monotonic() + self._settings.shutdown_timeout
        with anyio.move_on_after(self._settings.shutdown_timeout):
            await http_done.wait()
        flush_s = max(deadline - time.monotonic(), MIN_FLUSH_S)
        # Past the deadline, or with nothing left in flight: every model is unloaded (its actors' inboxes closed,
        # dependants first: each answers what is queued and ends; its scheduler fails what still runs, so open
        # streams get a clear error event; its prompt cache flushes its memory tier to disk once its scheduler has
        # ended, so no insert can follow). Then the registry's inbox and storage's close.
        with anyio.move_on_after(ACTOR_STOP_GRACE_S + flush_s):
            for outbox, done in reversed(self._started_actors):
                if outbox is self._registry_send:
                    await self._unload_models()
                outbox.close()
                await done.wait()
        for outbox in (self._registry_send, self._storage_send):
            outbox.close()
        with anyio.move_on_after(ERROR_FLUSH_S):
            await http_done.wait()
        task_group.cancel_scope.cancel()
        logger.info("stopped")

    async def _unload_models(self) -> None:
        with suppress(Refused):
            unloaded = await call(self._registry_send, lambda reply: UnloadAll(reply=reply))
            logger.info("%d models unloaded", unloaded)

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


def _load(model_id: str, reply: ReplyStream[LoadResult | RequestFailed]) -> LoadModel:
    return LoadModel(name=model_id, reply=reply)


def _unbound_outboxes(storage: MemoryObjectSendStream[StorageMessage]) -> Outboxes:
    """The outboxes of a context no model is bound to: storage, and per-model ones whose inboxes are closed (a route
    must bind its model, `AppContext.for_model`; one that did not is answered 503 rather than reaching any model)."""
    send, receive = anyio.create_memory_object_stream[Any](0)
    receive.close()
    return Outboxes(token_counter=send, ingress=send, compactor=send, storage=storage)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
