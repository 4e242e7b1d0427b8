"""Grammar work never holds a step for long: masks filled off the MLX thread with a bounded wait, fast-forward
searched within a time budget, and compiled grammars carried by the request (the engine never compiles)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import mlx_lm
import numpy as np
import pytest

from courier.engine import constrained
from courier.engine.batch_engine import BatchEngine
from courier.engine.constrained import ConstrainedSequence, MaskFiller
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest
from courier.engine.generation import (
    FinishReason,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
)
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import Constraint, json_schema
from tests.support.grammar import smollm2_compiler

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
SLOW_S = 0.3
LIMITS = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=64)


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm.load(str(tiny_llama_dir))
    return model, tokenizer


def constraint() -> Constraint:
    return json_schema(SCHEMA, name="person", param="response_format")


def slowed(filler: MaskFiller, *, seconds: float, only: threading.Event | None = None) -> None:
    """Make `filler`'s fills take `seconds` longer (all of them, or only while `only` is set)."""
    fill = filler._fill

    def slow(matcher: Any) -> Any:
        if only is None or only.is_set():
            time.sleep(seconds)
        return fill(matcher)

    filler._fill = slow  # type: ignore[method-assign]


def test_a_mask_not_ready_within_the_budget_is_not_waited_for(compiler: GrammarCompiler) -> None:
    filler = MaskFiller(compiler.vocab_size, 2, budget_s=0.05)
    quick, slow = filler.acquire(), filler.acquire()
    matchers = [compiler.matcher(constraint()) for _ in range(2)]
    late = threading.Event()
    fill = filler._fill

    def selective(matcher: Any) -> Any:
        if matcher is matchers[1]:
            late.wait(5)
        return fill(matcher)

    filler._fill = selective  # type: ignore[method-assign]
    filler.due(quick, matchers[0])
    filler.due(slow, matchers[1])
    started = time.perf_counter()
    mask = filler.row(quick)
    waited = time.perf_counter() - started
    late.set()
    assert mask is not None and mask.any()  # its neighbour's mask is served
    assert filler.row(slow) is None
    assert "step budget (0.05 s)" in filler.missing(slow)
    assert waited < 1.0 and filler.late == 1
    assert list(filler.fill_rows)[-1] == 2


def test_a_released_row_is_given_out_again_while_its_old_fill_still_runs(compiler: GrammarCompiler) -> None:
    filler = MaskFiller(compiler.vocab_size, 1, budget_s=0.01)
    slowed(filler, seconds=0.2)
    row = filler.acquire()
    filler.due(row, compiler.matcher(constraint()))
    assert filler.row(row) is None
    filler.release(row)
    again = filler.acquire()
    filler._fill = MaskFiller._fill.__get__(filler)  # type: ignore[method-assign]
    filler.due(again, compiler.matcher(constraint()))
    mask = filler.row(again)
    assert mask is not None and mask.any()  # its own array: the old fill writes elsewhere


def test_fast_forward_stops_at_its_budget_and_loses_nothing(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sequence() -> ConstrainedSequence:
        return ConstrainedSequence(
            constraint(),
            compiler=compiler,
            filler=MaskFiller(compiler.vocab_size, 1),
            decode=lambda tokens: compiler.tokenizer.decode_str(list(tokens)),
            prompt_length=0,
            sampler=lambda logprobs: logprobs,
            eos_tokens=compiler.eos_tokens,
        )

    opening = compiler.tokenizer.tokenize_str("{")
    unbounded = sequence().forced_after(opening[0], 16)
    assert compiler.tokenizer.decode_str(unbounded).startswith('"name')  # the key the schema forces
    monkeypatch.setattr(constrained, "FORCE_BUDGET_S", 0.0)
    bounded = sequence()
    assert bounded.forced_after(opening[0], 16) == []
    assert bounded.valid(unbounded) == len(unbounded)  # still allowed, to be sampled one by one


def request(name: str, rule: Constraint | None, max_tokens: int = 24) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=rule)
    return EngineRequest(request_id=RequestId(name), prompt_tokens=(1, 2, 3, 4), sampling=sampling)


def test_a_sequence_whose_mask_is_late_ends_cut_and_its_neighbour_runs_on(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS, grammars=compiler)
    masks = engine.masks
    assert masks is not None
    masks.budget_s = 0.05
    stall = threading.Event()
    slowed(masks, seconds=SLOW_S, only=stall)
    outputs: list[EngineOutput] = engine.step([request("json", compiler.compile(constraint(), "x"))], [])
    outputs += engine.step([request("free", None)], [])
    stall.set()
    started = time.perf_counter()
    outputs += engine.step([], [])
    held = time.perf_counter() - started
    stall.clear()
    for _ in range(40):
        if not engine.active:
            break
        outputs += engine.step([], [])
    ends = {str(o.request_id): o.event for o in outputs if isinstance(o.event, GenerationFinished)}
    assert ends["json"].reason is FinishReason.LENGTH  # cut, not a stop with partial JSON
    assert ends["free"].reason is FinishReason.LENGTH and ends["free"].completion_tokens == 24
    assert held < SLOW_S  # the step did not wait for the slow mask
    assert masks.late == 1
    free = "".join(o.event.text for o in outputs if o.request_id == "free" and isinstance(o.event, TokensGenerated))
    assert free


def test_the_engine_copies_the_grammar_the_request_carries(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(constraint(), "response_format")
    assert compiled == constraint() and compiled.compiled is not None  # equal: the compiled grammar is not its key
    stats = compiler.stats()
    matcher = compiler.matcher(compiled)
    assert compiler.stats().hits == stats.hits and compiler.stats().misses == stats.misses  # no cache lookup
    assert matcher is not compiled.compiled
    mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    assert mask.any()
