"""ModelRegistryActor: which models are loaded; loads them when asked for, unloads them for room or when idle.

Receives `AcquireModel` (a request's model: replies a `ModelLease` once the model is loaded, or `RequestFailed`:
not found, its load failed, it cannot fit), `LoadModel` / `UnloadModel` (an operator's; replied when done),
`UnloadAll` (at shutdown) and its own news: `LoadFinished`, `UnloadFinished`, `CheckResidency` (a model went idle,
or the periodic tick). It owns the residency of every model (`status/models.py`, read by the routes) and the
running models' `ModelRuntime`s, made by the injected `ModelLoader` (`server/model_runtime.py`).

A load runs in a task of its own (span `model_registry.load`) and reports back by message, so the inbox never
waits on it: requests for a loading model wait on that one load (their replies are held, as `SideTasks` holds
them), requests for loaded models are answered at once. Loads start one at a time, first asked first, each once
`core/served_models/residency.py` says it fits: idle models go first, least recently used first (span
`model_registry.unload`, reason `evict`), then busy ones, which take no new request and go once theirs have ended.
A model whose load failed is answered with that failure for `FAILED_HOLD_S` before it is tried again; one that
cannot fit at all is refused. Invariants: a model is never unloaded while a lease on it is held (only at shutdown,
when its scheduler fails what still runs); the budget counts every model that is loading, loaded or unloading.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.model_loading.held_replies import (
    HeldReplies,
    answer,
    load_failed,
    not_found,
    not_loaded,
    too_large,
)
from courier.core.served_models.residency import FOREVER, Residency, Resident, expired, fits_now, plan_room
from courier.messages.asking import STOPPED
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.model_registry import (
    AcquireModel,
    CheckResidency,
    LoadFinished,
    LoadModel,
    LoadResult,
    ModelLease,
    ModelRegistryMessage,
    ModelRuntime,
    UnloadAll,
    UnloadFinished,
    UnloadModel,
)
from courier.model.catalog import ModelCatalog, ModelDeclaration
from courier.runtime import trace_attributes
from courier.runtime.actor import Actor
from courier.runtime.tracing import TraceCarrier, carried_span
from courier.status.models import ModelsStatus, ModelStatus

logger = logging.getLogger(__name__)

TICK_S = 1.0
# A model whose load failed answers its requests with that failure this long before a request tries it again.
FAILED_HOLD_S = 30.0


class ModelLoader(Protocol):
    def check(self, declaration: ModelDeclaration) -> str | None:
        """Why the model cannot load, as far as a glance at its files tells (None: it may); asked before anything
        is unloaded for it."""
        ...

    async def load(self, declaration: ModelDeclaration, status: ModelStatus) -> ModelRuntime:
        """Load the model and start its actors; raise with a message saying why it cannot be loaded."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyLimits:
    budget_bytes: int
    max_loaded: int = 0  # 0: no count limit
    ttl_s: float = 0.0  # idle seconds before a model goes (0: only for room)


class ModelRegistryActor(Actor[ModelRegistryMessage]):
    name = "model_registry"

    def __init__(
        self,
        catalog: ModelCatalog,
        status: ModelsStatus,
        loader: ModelLoader,
        limits: ResidencyLimits,
        outbox: MemoryObjectSendStream[ModelRegistryMessage],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._catalog = catalog
        self._status = status
        self._loader = loader
        self._limits = limits
        self._outbox = outbox  # its own inbox, for the news of its tasks; closed once everything is unloaded
        self._clock = clock
        self._runtimes: dict[str, ModelRuntime] = {}
        self._waiting: dict[str, HeldReplies] = {model.model_id: HeldReplies() for model in catalog.models}
        self._queue: deque[str] = deque()  # loads wanted, not started: first asked first
        self._busy: set[str] = set()  # a load or an unload task runs
        self._failed: dict[str, tuple[float, str]] = {}
        self._stopping: list[MemoryObjectSendStream[Any]] | None = None
        self._stopped_count = 0
        self._tasks: TaskGroup | None = None
        self._tasks_ready = anyio.Event()
        for model in status.models.values():
            model.leases.on_idle = self._wake

    async def background(self) -> None:
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            self._tasks_ready.set()
            while True:
                await anyio.sleep(TICK_S)
                self._wake()

    async def handle(self, message: ModelRegistryMessage) -> None:
        await self._tasks_ready.wait()
        match message:
            case AcquireModel():
                self._on_acquire(message)
            case LoadModel():
                self._on_load(message)
            case UnloadModel():
                self._on_unload(message)
            case UnloadAll():
                self._on_unload_all(message)
            case LoadFinished():
                await self._on_load_finished(message)
            case UnloadFinished():
                self._on_unload_finished(message)
            case CheckResidency():
                pass
        self._pump()
        self._finish_stopping()

    def _on_acquire(self, message: AcquireModel) -> None:
        model = self._model(message.name, message.reply)
        if model is None:
            return
        keep_alive = message.keep_alive if message.keep_alive is not None else (self._limits.ttl_s or FOREVER)
        if model.residency is Residency.LOADED:
            answer(message.reply, self._lease(model, keep_alive, glance=message.if_loaded))
        elif message.if_loaded:
            answer(message.reply, not_loaded(model.model_id))
        elif self._refused_recently(model.model_id, message.reply) or self._unloadable(model, message.reply):
            return
        else:
            self._wait(model, message.trace).leases.append((message.reply.clone(), keep_alive))

    def _on_load(self, message: LoadModel) -> None:
        model = self._model(message.name, message.reply)
        if model is None:
            return
        if model.residency is Residency.LOADED:
            answer(message.reply, LoadResult(model_id=model.model_id, state=model.residency.value))
        elif not self._unloadable(model, message.reply):
            self._failed.pop(model.model_id, None)  # an operator's load is always tried
            self._wait(model, message.trace).operators.append(message.reply.clone())

    def _on_unload(self, message: UnloadModel) -> None:
        model = self._model(message.name, message.reply)
        if model is None:
            return
        model_id = model.model_id
        if model.residency is Residency.NOT_LOADED:
            answer(message.reply, LoadResult(model_id=model_id, state=model.residency.value))
        elif model_id in self._queue or (model.residency is Residency.LOADING):
            failure = f"the model '{model_id}' is loading; unload it once it has loaded"
            answer(message.reply, RequestFailed(kind=FailureKind.INVALID_REQUEST, message=failure, param="model"))
        else:
            self._waiting[model_id].unloads.append(message.reply.clone())
            self._begin_unload(model, "asked by an operator", message.trace)

    def _on_unload_all(self, message: UnloadAll) -> None:
        self._stopping = [message.reply.clone()]
        self._stopped_count = len(self._runtimes) + len(self._busy)
        while self._queue:
            self._fail_waiting(self._status.models[self._queue.popleft()], STOPPED)
        for model in self._status.models.values():
            if model.residency is Residency.LOADED:
                self._begin_unload(model, "shutting down", message.trace)

    async def _on_load_finished(self, message: LoadFinished) -> None:
        model = self._status.models[message.model_id]
        self._busy.discard(model.model_id)
        model.progress = None
        if message.runtime is None:
            model.residency = Residency.NOT_LOADED
            model.error = message.error
            self._failed[model.model_id] = (self._clock(), message.error or "unknown")
            logger.error("model %s could not be loaded: %s", model.model_id, message.error)
            self._fail_waiting(model, load_failed(model.model_id, message.error or "unknown"))
            return
        runtime = message.runtime
        self._runtimes[model.model_id] = runtime
        model.residency = Residency.LOADED
        model.error = None
        model.weights_bytes, model.weights_measured = runtime.weights_bytes, True
        model.charge_bytes = runtime.charge_bytes
        model.loads += 1
        model.load_seconds = round(message.seconds, 3)
        model.capabilities = model.state.capabilities()
        model.leases.loaded(self._limits.ttl_s or FOREVER)  # idle from now, not from its use before an unload
        logger.info(
            "model %s loaded in %.1f s: weights %d bytes, charged %d bytes (%d of the budget's %d bytes in use)",
            model.model_id,
            message.seconds,
            runtime.weights_bytes,
            runtime.charge_bytes,
            self._status.charged_bytes,
            self._limits.budget_bytes,
        )
        if self._stopping is not None:
            self._begin_unload(model, "shutting down", message.trace)
        loaded = LoadResult(model_id=model.model_id, state="loaded", load_seconds=message.seconds)
        self._waiting[model.model_id].loaded(partial(self._lease, model), loaded)
        self._make_room_for_measured(model)

    def _on_unload_finished(self, message: UnloadFinished) -> None:
        model = self._status.models[message.model_id]
        self._busy.discard(model.model_id)
        self._runtimes.pop(model.model_id, None)
        model.residency = Residency.NOT_LOADED
        model.unloads += 1
        logger.info("model %s unloaded; its prompt cache's disk tier stays for its next load", model.model_id)
        waiting = self._waiting[model.model_id]
        waiting.unloaded(LoadResult(model_id=model.model_id, state=model.residency.value))
        if waiting.want_load() or model.model_id in self._queue:
            model.residency, model.progress = Residency.LOADING, "queued"  # asked for while it was unloading
            self._want(model)

    def _finish_stopping(self) -> None:
        """Once every model is unloaded at shutdown: answer `UnloadAll`, and let the inbox end."""
        if self._stopping is None or self._runtimes or self._busy:
            return
        for reply in self._stopping:
            answer(reply, self._stopped_count, close=True)
        self._stopping.clear()
        self._outbox.close()

    def _pump(self) -> None:
        """Start whatever is now due: unloads of expired models, the next load, unloads whose requests have ended."""
        if self._stopping is None:
            for model_id in expired(self._status.residents(), self._clock()):
                self._begin_unload(self._status.models[model_id], "idle past its keep-alive", {})
            self._start_next_load()
        for model in self._status.models.values():
            idle = self._stopping is not None or model.leases.in_flight == 0
            if model.residency is Residency.UNLOADING and model.model_id not in self._busy and idle:
                self._start(model.model_id, self._unload_task(model))

    def _start_next_load(self) -> None:
        """The loads asked for, first asked first, each once it fits (what must go for it begins to go)."""
        for model_id in list(self._queue):
            model = self._status.models[model_id]
            if model.residency is Residency.UNLOADING:
                continue  # asked for again while unloading: loaded once it is gone; the others need not wait for it
            need = model.charge_bytes or 0
            others = self._others()
            room = plan_room(others, need=need, budget=self._limits.budget_bytes, max_loaded=self._limits.max_loaded)
            if not room.fits:
                self._queue.remove(model_id)
                model.residency = Residency.NOT_LOADED
                model.error = f"cannot be loaded: {room.refused}"
                self._fail_waiting(model, too_large(model.model_id, room.refused or ""))
                continue
            if room.wait:
                model.progress = "waiting for other models to finish loading"
                return
            trace = self._waiting[model.model_id].trace
            for victim in (*room.evict, *room.drain):
                self._begin_unload(self._status.models[victim], f"to make room for {model.model_id}", trace)
            if not fits_now(others, need=need, budget=self._limits.budget_bytes, max_loaded=self._limits.max_loaded):
                model.progress = "waiting for memory: " + ", ".join(sorted(_unloading(self._status)))
                return
            self._queue.remove(model_id)
            model.residency, model.progress = Residency.LOADING, "starting"
            self._start(model.model_id, self._load_task(model, trace))

    def _others(self) -> list[Resident]:
        """What holds memory besides the loads not started yet."""
        queued = set(self._queue)
        return [r for r in self._status.residents() if not (r.name in queued and r.residency is Residency.LOADING)]

    def _make_room_for_measured(self, loaded: ModelStatus) -> None:
        """A model weighed more than its estimate: idle others go until the budget holds again."""
        others = [r for r in self._others() if r.name != loaded.model_id]
        room = plan_room(others, need=loaded.charge_bytes or 0, budget=self._limits.budget_bytes)
        for victim in room.evict:
            self._begin_unload(self._status.models[victim], f"over budget after {loaded.model_id} loaded", {})

    def _begin_unload(self, model: ModelStatus, reason: str, trace: TraceCarrier) -> None:
        if model.residency is not Residency.LOADED:
            return
        model.residency = Residency.UNLOADING
        model.progress = f"unloading: {reason}"
        self._waiting[model.model_id].trace = self._waiting[model.model_id].trace or trace
        logger.info(
            "unloading model %s (%s)%s",
            model.model_id,
            reason,
            f"; waiting for its {model.leases.in_flight} requests in flight" if model.leases.in_flight else "",
        )

    def _want(self, model: ModelStatus) -> None:
        if model.model_id in self._queue or model.model_id in self._busy:
            return
        self._queue.append(model.model_id)
        if model.residency is Residency.NOT_LOADED:
            model.residency = Residency.LOADING
            model.progress = "queued"

    def _wait(self, model: ModelStatus, trace: TraceCarrier) -> HeldReplies:
        waiting = self._waiting[model.model_id]
        if not waiting.want_load():
            waiting.trace = trace
        self._want(model)
        return waiting

    def _start(self, model_id: str, work: Awaitable[None]) -> None:
        assert self._tasks is not None
        self._busy.add(model_id)

        async def run() -> None:
            await work

        self._tasks.start_soon(run)

    async def _load_task(self, model: ModelStatus, trace: TraceCarrier) -> None:
        declaration = self._catalog.get(model.model_id)
        started = self._clock()
        logger.info("loading model %s (%s)", model.model_id, declaration.source.describe())
        runtime: ModelRuntime | None = None
        error: str | None = None
        with carried_span("model_registry.load", trace, {trace_attributes.MODEL: model.model_id}) as span:
            try:
                runtime = await self._loader.load(declaration, model)
            except Exception as failure:  # one model's failure is that model's; the registry serves the others
                error = str(failure) or type(failure).__name__
                if type(failure).__name__ != "ModelLoadError":
                    logger.exception("loading model %s failed unexpectedly", model.model_id)
                span.set_attribute(trace_attributes.FAILURE, error)
        finished = LoadFinished(model_id=model.model_id, runtime=runtime, error=error, seconds=self._clock() - started)
        if not await self._tell(finished) and runtime is not None:
            await runtime.unload()  # the registry stopped while it loaded

    async def _unload_task(self, model: ModelStatus) -> None:
        runtime = self._runtimes.get(model.model_id)
        trace = self._waiting[model.model_id].trace
        attributes = {trace_attributes.MODEL: model.model_id, "courier.model.unload_reason": model.progress or ""}
        with carried_span("model_registry.unload", trace, attributes):
            if runtime is not None:
                try:
                    await runtime.unload()
                except Exception:  # its actors are stopped either way; the memory may not all come back
                    logger.exception("unloading model %s failed", model.model_id)
        self._waiting[model.model_id].trace = {}
        await self._tell(UnloadFinished(model_id=model.model_id))

    async def _tell(self, message: ModelRegistryMessage) -> bool:
        try:
            await self._outbox.send(message)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    def _wake(self) -> None:
        with suppress(anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._outbox.send_nowait(CheckResidency())

    def _lease(self, model: ModelStatus, keep_alive: float, *, glance: bool = False) -> ModelLease:
        model.leases.take(glance=glance)
        outboxes = self._runtimes[model.model_id].outboxes
        return ModelLease(model.model_id, outboxes, model.leases, keep_alive, glance=glance)

    def _model(self, name: str | None, reply: MemoryObjectSendStream[Any]) -> ModelStatus | None:
        if self._stopping is not None:
            answer(reply, STOPPED)
            return None
        declaration = self._catalog.find(name)
        if declaration is None:
            answer(reply, not_found(name or "", self._catalog))
            return None
        return self._status.models[declaration.model_id]

    def _refused_recently(self, model_id: str, reply: MemoryObjectSendStream[Any]) -> bool:
        failed = self._failed.get(model_id)
        if failed is None or self._clock() - failed[0] >= FAILED_HOLD_S:
            self._failed.pop(model_id, None)
            return False
        answer(reply, load_failed(model_id, failed[1]))
        return True

    def _unloadable(self, model: ModelStatus, reply: MemoryObjectSendStream[Any]) -> bool:
        """A model whose files cannot load is refused before anything is unloaded for it (not when already asked
        for: its load is on its way; nor when it is the only model: nothing else could be unloaded, and its load
        says best why it fails)."""
        if model.residency is not Residency.NOT_LOADED or not self._catalog.several:
            return False
        problem = self._loader.check(self._catalog.get(model.model_id))
        if problem is None:
            return False
        model.error = problem
        answer(reply, load_failed(model.model_id, problem))
        return True

    def _fail_waiting(self, model: ModelStatus, failure: RequestFailed) -> None:
        self._waiting[model.model_id].fail(failure)


def _unloading(status: ModelsStatus) -> set[str]:
    return {model.model_id for model in status.models.values() if model.residency is Residency.UNLOADING}
