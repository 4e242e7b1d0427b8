"""BatchEngine on a real tiny model: batching, cancellation, and a failing forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from courier.core.batch_engine import BatchEngine, BatchLimits, EngineOutput, EngineRequest
from courier.messages.base import RequestId
from courier.messages.generation import FinishReason, GenerationFailed, GenerationFinished, SamplingParams

LIMITS = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=64)


class FailingOnce:
    """Wraps a real model; its next forward pass raises, as a fault inside MLX would."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.armed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise RuntimeError("simulated kernel fault")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(tiny_llama_dir))
    return model, tokenizer


def request(name: str, max_tokens: int, prompt: tuple[int, ...] = (1, 2, 3, 4)) -> EngineRequest:
    return EngineRequest(
        request_id=RequestId(name), prompt_tokens=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0)
    )


def run_until_done(engine: BatchEngine, outputs: list[EngineOutput], steps: int = 200) -> list[EngineOutput]:
    for _ in range(steps):
        if not engine.active:
            break
        outputs.extend(engine.step([], []))
    return outputs


def finished(outputs: list[EngineOutput]) -> dict[str, Any]:
    return {o.request_id: o.event for o in outputs if isinstance(o.event, GenerationFinished | GenerationFailed)}


def test_requests_joining_a_running_batch_all_finish(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = engine.step([request("a", 6)], [])
    outputs += engine.step([request("b", 3, (5, 6, 7))], [])  # joins while "a" decodes
    run_until_done(engine, outputs)
    ends = finished(outputs)
    assert set(ends) == {"a", "b"}
    assert ends["a"].completion_tokens == 6 and ends["a"].reason is FinishReason.LENGTH
    assert ends["b"].completion_tokens == 3


def test_cancelled_request_leaves_the_batch(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = engine.step([request("keep", 5), request("drop", 1000)], [])
    outputs += engine.step([], [RequestId("drop")])
    assert engine.active == 1
    run_until_done(engine, outputs)
    assert set(finished(outputs)) == {"keep"}


def test_a_failing_step_fails_that_batch_and_the_engine_keeps_serving(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    flaky = FailingOnce(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS)
    outputs = engine.step([request("x", 50), request("y", 50)], [])
    flaky.armed = True
    outputs += engine.step([], [])
    failed = finished(outputs)
    assert set(failed) == {"x", "y"}
    assert all(
        isinstance(event, GenerationFailed) and "simulated kernel fault" in event.message for event in failed.values()
    )
    assert engine.active == 0
    after = run_until_done(engine, engine.step([request("z", 4)], []))
    assert isinstance(finished(after)["z"], GenerationFinished)


def test_an_empty_prompt_fails_only_its_request(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = engine.step([request("empty", 4, ()), request("fine", 2)], [])
    run_until_done(engine, outputs)
    ends = finished(outputs)
    assert isinstance(ends["empty"], GenerationFailed)
    assert isinstance(ends["fine"], GenerationFinished)
