"""A stand-in for `BatchEngine` that runs on the real MLX thread: it records each step and answers with scripted
outputs, so the scheduler can be driven step by step without a model."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.engine_io import EngineOutput, EngineRequest
from courier.engine.generation import RequestId
from courier.engine.speculative_batch import SpeculationCounters
from courier.runtime.mlx_thread import THREAD_NAME


@dataclass(frozen=True, slots=True)
class Step:
    """What one engine step was given."""

    added: tuple[EngineRequest, ...]
    cancelled: tuple[RequestId, ...]
    expired: tuple[RequestId, ...] = ()


class FakeEngine:
    """Stands in for `BatchEngine`: records each step and answers it with the next scripted outputs.

    A step with nothing scripted waits on the MLX thread until the test scripts its outputs (`then`) or closes
    the engine. Reading `model` is counted: only a warm-up that really runs needs it.
    """

    speculation_mode = "off (a scripted engine)"
    kv_quantization = None  # the batch KV as computed (no --kv-bits)
    snapshot_quantization: KvQuantization | None = None  # what a warm-up's snapshot is stored as

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.speculation = SpeculationCounters()
        self.model_reads = 0
        # What the step admitting the waiting requests is estimated at (`admission_seconds`), and what was asked.
        self.admission_estimate = 0.0
        self.admissions_estimated: list[list[tuple[int, int]]] = []
        self._script: deque[list[EngineOutput]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._loop = asyncio.get_running_loop()  # the MLX thread tells the test's loop about each step
        self._stepped = anyio.Event()

    @property
    def model(self) -> object:
        self.model_reads += 1
        return object()

    def then(self, *outputs: EngineOutput) -> None:
        """Script the outputs of the next step still unanswered."""
        with self._ready:
            self._script.append(list(outputs))
            self._ready.notify_all()

    def close(self) -> None:
        """Release a step still waiting for its script (it answers nothing)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def admission_seconds(self, prompts: Sequence[tuple[int, int]]) -> float:
        self.admissions_estimated.append(list(prompts))
        return self.admission_estimate

    def step(
        self, added: Sequence[EngineRequest], cancelled: Sequence[RequestId], expired: Sequence[RequestId] = ()
    ) -> list[EngineOutput]:
        assert threading.current_thread().name == THREAD_NAME, "the engine steps on the MLX thread only"
        self.steps.append(Step(tuple(added), tuple(cancelled), tuple(expired)))
        self._loop.call_soon_threadsafe(self._notify)
        with self._ready:
            self._ready.wait_for(lambda: bool(self._script) or self._closed)
            return self._script.popleft() if self._script else []

    async def wait_for_steps(self, count: int) -> None:
        """Until the engine has been stepped at least `count` times (the last one may still wait for its script)."""
        while len(self.steps) < count:
            self._stepped = anyio.Event()
            await self._stepped.wait()

    def _notify(self) -> None:
        self._stepped.set()
