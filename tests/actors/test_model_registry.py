"""The model registry over real streams, with a fake loader whose loads the test lets finish, and a fake clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.model_registry import FAILED_HOLD_S, ModelRegistryActor, ResidencyLimits
from courier.core.failure_codes import FailureCode
from courier.core.served_models.names import ServedNames
from courier.core.served_models.residency import Leases, Residency
from courier.messages.asking import Refused, call
from courier.messages.model_registry import (
    AcquireModel,
    CheckResidency,
    LoadModel,
    LoadResult,
    ModelLease,
    ModelOutboxes,
    ModelRegistryMessage,
    UnloadAll,
    UnloadModel,
)
from courier.model.catalog import ModelCatalog, ModelDeclaration
from courier.model.loader import ModelLoadError
from courier.model.source import ModelSource, SourceKind
from courier.platform.blas import BlasReport
from courier.status.models import ModelsStatus, ModelStatus
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState

pytestmark = pytest.mark.anyio
BLAS = BlasReport(library="reference", path=None, optimized=False, detail="test")
GiB = 1024**3
TURNS = 10_000  # scheduler turns `until` gives a condition: far more than any of these needs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRuntime:
    model_id: str
    outboxes: ModelOutboxes
    weights_bytes: int
    charge_bytes: int
    unloaded: anyio.Event = field(default_factory=anyio.Event)

    async def unload(self) -> None:
        self.unloaded.set()


class FakeLoader:
    """Each load waits for the test's `finish(model_id)` unless `instant`; `fail` names models that fail."""

    def __init__(self, charges: dict[str, int], *, instant: bool = True) -> None:
        self.charges = charges
        self.instant = instant
        self.fail: set[str] = set()
        self.broken: set[str] = set()  # its files show it cannot load
        self.loads: list[str] = []
        self.runtimes: dict[str, FakeRuntime] = {}
        self._gates: dict[str, anyio.Event] = {}
        self.started = anyio.Event()
        self._streams = anyio.create_memory_object_stream[Any](1)
        send = self._streams[0]
        self._outboxes = ModelOutboxes(token_counter=send, ingress=send, compactor=send)

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

    def check(self, declaration: ModelDeclaration) -> str | None:
        return "no weights" if declaration.model_id in self.broken else None

    async def load(self, declaration: ModelDeclaration, status: ModelStatus) -> FakeRuntime:
        model_id = declaration.model_id
        self.loads.append(model_id)
        self.started.set()
        if not self.instant:
            self._gates[model_id] = anyio.Event()
            await self._gates[model_id].wait()
        if model_id in self.fail:
            raise ModelLoadError(f"{model_id}: config.json is not valid JSON")
        runtime = FakeRuntime(model_id, self._outboxes, self.charges[model_id], self.charges[model_id])
        self.runtimes[model_id] = runtime
        return runtime

    async def finish(self, model_id: str) -> None:
        await until(lambda: model_id in self._gates, f"{model_id} loading")
        self._gates.pop(model_id).set()


async def until(check: Callable[[], bool], what: str) -> None:
    """Let the registry and its tasks run (no clock involved) until `check()` holds."""
    for _ in range(TURNS):
        if check():
            return
        await anyio.sleep(0)
    raise AssertionError(f"never: {what}")


def catalog(*names: str) -> ModelCatalog:
    return ModelCatalog(
        tuple(
            ModelDeclaration(
                names=ServedNames((name, f"{name}-alias")),
                source=ModelSource(kind=SourceKind.MLX_DIRECTORY, location=f"/models/{name}", default_id=name),
            )
            for name in names
        )
    )


@dataclass
class Registry:
    inbox: MemoryObjectSendStream[ModelRegistryMessage]
    status: ModelsStatus
    loader: FakeLoader
    clock: Clock
    asked: int = 0  # `AcquireModel`s sent

    def model(self, name: str) -> ModelStatus:
        return self.status.models[name]

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> ModelLease:
        def ask(reply: Any) -> AcquireModel:
            self.asked += 1
            return AcquireModel(name=name, keep_alive=keep_alive, reply=reply)

        return await call(self.inbox, ask)

    async def unload(self, name: str, into: list[LoadResult]) -> None:
        """An operator's unload of `name`, its answer appended to `into` (run it in a task: it waits)."""
        into.append(await call(self.inbox, lambda reply: UnloadModel(name=name, reply=reply)))

    async def read(self, asked: int) -> None:
        """Until `asked` acquires have been sent and the registry has taken every message from its inbox: what
        it is sent next is handled after them."""
        await until(lambda: self.asked == asked and not self.inbox.statistics().current_buffer_used, "inbox read")

    async def settle(self) -> None:
        """Let the registry handle what its tasks told it."""
        for _ in range(20):
            await anyio.sleep(0)
        self.inbox.send_nowait(CheckResidency())
        for _ in range(20):
            await anyio.sleep(0)


@asynccontextmanager
async def registry(
    names: tuple[str, ...] = ("a", "b", "c"),
    *,
    budget: int = 10 * GiB,
    charges: dict[str, int] | None = None,
    pins: tuple[str, ...] = (),
    max_loaded: int = 0,
    ttl_s: float = 0.0,
    instant: bool = True,
) -> AsyncIterator[Registry]:
    clock = Clock()
    models = catalog(*names)
    status = ModelsStatus(budget_bytes=budget, max_loaded=max_loaded)
    for model in models.models:
        state = ServiceState(blas=BLAS, model_id=model.model_id, scheduler=SchedulerStats(max_batch=1, max_queue=1))
        status.models[model.model_id] = ModelStatus(
            names=model.names,
            source=model.source.describe(),
            state=state,
            leases=Leases(clock),
            pinned=model.model_id in pins,
            charge_bytes=(charges or {}).get(model.model_id, GiB),
        )
    loader = FakeLoader({name: (charges or {}).get(name, GiB) for name in names}, instant=instant)
    send, receive = anyio.create_memory_object_stream[ModelRegistryMessage](64)
    limits = ResidencyLimits(budget_bytes=budget, max_loaded=max_loaded, ttl_s=ttl_s)
    actor = ModelRegistryActor(models, status, loader, limits, send.clone(), clock=clock)
    async with anyio.create_task_group() as tasks:
        await tasks.start(partial(actor.run), receive)
        with send:
            yield Registry(send, status, loader, clock)
            with anyio.fail_after(5):
                await call(send, lambda reply: UnloadAll(reply=reply))
        tasks.cancel_scope.cancel()
    loader.close()


async def test_a_request_loads_its_model_and_concurrent_ones_wait_on_that_one_load() -> None:
    async with registry(instant=False) as test:
        leases: list[ModelLease] = []

        async def acquire(name: str) -> None:
            leases.append(await test.acquire(name))

        async with anyio.create_task_group() as requests:
            requests.start_soon(acquire, "a")
            requests.start_soon(acquire, "a-alias")
            requests.start_soon(acquire, "a")
            await test.loader.started.wait()
            await test.read(asked=3)
            assert test.model("a").residency is Residency.LOADING
            await test.loader.finish("a")
        assert test.loader.loads == ["a"]
        assert [lease.model_id for lease in leases] == ["a", "a", "a"]
        assert test.model("a").leases.in_flight == 3
        assert test.model("a").residency is Residency.LOADED
        for lease in leases:
            lease.release()
            lease.release()  # twice gives back nothing more
        assert test.model("a").leases.in_flight == 0
        assert (await test.acquire(None)).model_id == "a"  # the default, loaded: answered at once
        assert test.loader.loads == ["a"]


async def test_an_unknown_model_is_not_found() -> None:
    async with registry() as test:
        with pytest.raises(Refused) as refused:
            await test.acquire("nope")
        assert refused.value.failure.code is FailureCode.MODEL_NOT_FOUND
        assert "'a', 'b', 'c'" in refused.value.failure.message


async def test_a_failed_load_fails_its_waiters_only_and_is_held_before_it_is_tried_again() -> None:
    async with registry() as test:
        test.loader.fail.add("b")
        for _ in range(2):
            with pytest.raises(Refused) as refused:
                await test.acquire("b")
            assert refused.value.failure.code is FailureCode.MODEL_LOAD_FAILED
            assert "config.json is not valid JSON" in refused.value.failure.message
        assert test.loader.loads == ["b"]  # the second was answered from the failure held
        assert test.model("b").residency is Residency.NOT_LOADED
        assert "not valid JSON" in (test.model("b").error or "")
        assert (await test.acquire("a")).model_id == "a"  # the others are served
        test.clock.now += FAILED_HOLD_S
        test.loader.fail.clear()
        assert (await test.acquire("b")).model_id == "b"
        assert test.loader.loads == ["b", "a", "b"]


async def test_a_model_whose_files_cannot_load_unloads_nothing() -> None:
    async with registry(budget=GiB) as test:
        (await test.acquire("a")).release()
        test.loader.broken.add("b")
        with pytest.raises(Refused) as refused:
            await test.acquire("b")
        assert refused.value.failure.code is FailureCode.MODEL_LOAD_FAILED
        assert "no weights" in refused.value.failure.message
        assert test.model("a").residency is Residency.LOADED
        assert test.loader.loads == ["a"]


async def test_the_least_recently_used_idle_model_makes_room() -> None:
    async with registry(budget=2 * GiB) as test:
        (await test.acquire("a")).release()
        test.clock.now += 1
        (await test.acquire("b")).release()
        test.clock.now += 1
        lease = await test.acquire("c")  # a is the oldest
        assert test.loader.runtimes["a"].unloaded.is_set()
        assert not test.loader.runtimes["b"].unloaded.is_set()
        assert [test.model(name).residency for name in "abc"] == [
            Residency.NOT_LOADED,
            Residency.LOADED,
            Residency.LOADED,
        ]
        assert test.status.charged_bytes == 2 * GiB
        lease.release()


async def test_a_busy_model_is_unloaded_only_once_its_requests_end() -> None:
    async with registry(budget=GiB) as test:
        streaming = await test.acquire("a")
        waiter: list[ModelLease] = []

        async def acquire_b() -> None:
            waiter.append(await test.acquire("b"))

        async with anyio.create_task_group() as requests:
            requests.start_soon(acquire_b)
            await until(lambda: "waiting for memory: a" in (test.model("b").progress or ""), "b waiting for a")
            assert test.model("a").residency is Residency.UNLOADING
            assert test.model("b").residency is Residency.LOADING
            assert "waiting for memory: a" in (test.model("b").progress or "")
            assert not test.loader.runtimes["a"].unloaded.is_set()
            streaming.release()  # the stream ends: a goes, b loads
        assert test.loader.runtimes["a"].unloaded.is_set()
        assert waiter[0].model_id == "b"
        assert test.loader.loads == ["a", "b"]


async def test_a_request_for_a_model_being_unloaded_loads_it_again() -> None:
    async with registry(budget=GiB) as test:
        streaming = await test.acquire("a")
        results: list[str] = []

        async def acquire(name: str) -> None:
            lease = await test.acquire(name)
            results.append(lease.model_id)
            lease.release()

        async with anyio.create_task_group() as requests:
            requests.start_soon(acquire, "b")
            await until(lambda: test.model("a").residency is Residency.UNLOADING, "a unloading for b")
            requests.start_soon(acquire, "a")
            await test.read(asked=3)  # a's second request is held while a unloads
            streaming.release()
        assert results == ["b", "a"]
        assert test.loader.loads == ["a", "b", "a"]


async def test_idle_models_go_after_the_ttl_and_keep_alive_overrides_it() -> None:
    async with registry(ttl_s=60) as test:
        (await test.acquire("a")).release()
        (await test.acquire("b", keep_alive=600)).release()
        (await test.acquire("c", keep_alive=0)).release()  # Ollama's keep_alive 0: unloaded as it goes idle
        await test.settle()
        assert test.model("c").residency is Residency.NOT_LOADED
        test.clock.now += 61
        await test.settle()
        assert test.model("a").residency is Residency.NOT_LOADED
        assert test.model("b").residency is Residency.LOADED
        test.clock.now += 600
        await test.settle()
        assert test.model("b").residency is Residency.NOT_LOADED


async def test_a_pinned_model_stays_and_one_that_cannot_fit_beside_it_is_refused() -> None:
    async with registry(budget=GiB, pins=("a",), ttl_s=1) as test:
        (await test.acquire("a")).release()
        test.clock.now += 10
        await test.settle()
        assert test.model("a").residency is Residency.LOADED
        with pytest.raises(Refused) as refused:
            await test.acquire("b")
        assert refused.value.failure.code is FailureCode.MODEL_TOO_LARGE
        assert "a (loaded, pinned)" in refused.value.failure.message
        assert test.model("a").residency is Residency.LOADED


async def test_max_loaded_models_counts_models_whatever_their_size() -> None:
    async with registry(max_loaded=1) as test:
        (await test.acquire("a")).release()
        (await test.acquire("b")).release()
        assert test.model("a").residency is Residency.NOT_LOADED


async def test_an_operator_loads_and_unloads_by_hand() -> None:
    async with registry() as test:
        loaded = await call(test.inbox, lambda reply: LoadModel(name="b", reply=reply))
        assert (loaded.model_id, loaded.state) == ("b", "loaded")
        assert test.model("b").residency is Residency.LOADED
        lease = await test.acquire("b")
        unloading: list[LoadResult] = []
        async with anyio.create_task_group() as operator:
            operator.start_soon(test.unload, "b-alias", unloading)
            await until(lambda: test.model("b").residency is Residency.UNLOADING, "b unloading")
            assert test.model("b").residency is Residency.UNLOADING  # waits for the request in flight
            assert not unloading
            lease.release()
        assert unloading[0].state == "not_loaded"
        again = await call(test.inbox, lambda reply: UnloadModel(name="b", reply=reply))
        assert again.state == "not_loaded"


async def test_at_shutdown_every_model_is_unloaded_and_requests_are_refused() -> None:
    async with registry() as test:
        lease = await test.acquire("a")
        await call(test.inbox, lambda reply: LoadModel(name="b", reply=reply))
        unloaded = await call(test.inbox, lambda reply: UnloadAll(reply=reply))
        assert unloaded == 2
        assert test.loader.runtimes["a"].unloaded.is_set()  # a lease held does not hold up a shutdown
        assert test.loader.runtimes["b"].unloaded.is_set()
        lease.release()
        with pytest.raises(Refused) as refused:
            await test.acquire("a")
        assert refused.value.failure.code is FailureCode.SHUTTING_DOWN


async def test_a_model_loaded_again_is_idle_from_its_load_not_from_its_use_before() -> None:
    """Its timer from before its unload had run out: a model loaded again (by hand, or after `keep_alive: 0`) must
    not be unloaded at once, and one loaded by hand and never used still goes after `--model-ttl`."""
    async with registry(ttl_s=60) as test:
        (await test.acquire("b", keep_alive=0)).release()
        await test.settle()
        assert test.model("b").residency is Residency.NOT_LOADED
        test.clock.now += 100
        loaded = await call(test.inbox, lambda reply: LoadModel(name="b", reply=reply))
        assert loaded.state == "loaded"
        await test.settle()
        assert (test.model("b").residency, test.model("b").unloads) == (Residency.LOADED, 1)
        test.clock.now += 61
        await test.settle()
        assert test.model("b").residency is Residency.NOT_LOADED  # idle past the ttl since its load


async def test_reading_a_models_figures_is_no_use_of_it() -> None:
    """`/metrics` and cache stats take a glance at a loaded model: it holds the model while they read, but neither
    renews its idle timer nor moves it up the eviction order."""
    async with registry(ttl_s=60) as test:
        (await test.acquire("a")).release()
        used = test.model("a").leases.last_used
        for _ in range(5):
            test.clock.now += 50
            glance = await call(test.inbox, lambda reply: AcquireModel(name="a", if_loaded=True, reply=reply))
            assert test.model("a").leases.in_flight == 1  # held while its figures are read
            glance.release()
            await test.settle()
            if test.model("a").residency is not Residency.LOADED:
                break
        assert test.model("a").residency is Residency.NOT_LOADED
        assert test.model("a").leases.last_used == used


async def test_a_model_waiting_for_its_own_unload_holds_up_no_other_load() -> None:
    async with registry() as test:
        streaming = await test.acquire("a")
        unloading: list[LoadResult] = []
        async with anyio.create_task_group() as requests:
            requests.start_soon(test.unload, "a", unloading)
            await until(lambda: test.model("a").residency is Residency.UNLOADING, "a unloading")
            again: list[ModelLease] = []

            async def acquire_a() -> None:
                again.append(await test.acquire("a"))  # queued behind a's own unload

            requests.start_soon(acquire_a)
            await test.read(asked=2)
            with anyio.fail_after(5):
                other = await test.acquire("c")  # fits beside a: loads while a drains
            assert other.model_id == "c" and test.model("a").residency is Residency.UNLOADING
            other.release()
            streaming.release()
        assert [lease.model_id for lease in again] == ["a"] and unloading[0].state == "not_loaded"
        again[0].release()
