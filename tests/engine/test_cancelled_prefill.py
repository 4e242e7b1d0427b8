"""A request cancelled in the middle of its prefill leaves the state it had prefilled, and a resend starts from it.

On real tiny models, dense (llama: KV cache) and hybrid (qwen3-next: recurrent state that cannot be trimmed): the
kept state is the state after the prompt tokens it covers, so the same prompt resumed from it writes what it writes
from scratch, and counts those tokens as cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from courier.core.prompt_cache.entries import Origin
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import GenerationFinished, RequestId, SamplingParams, TokensGenerated
from courier.engine.model_state import CachedPrefix

CHUNK = 64
LIMITS = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=CHUNK)
PROMPT = tuple(range(10, 10 + 5 * CHUNK + 7))  # five chunks and a bit


@pytest.fixture(scope="module", params=["llama", "qwen3-next"])
def loaded(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    directory: Path = request.getfixturevalue("tiny_llama_dir" if request.param == "llama" else "tiny_qwen3_next_dir")
    model, tokenizer = mlx_lm.load(str(directory))
    return model, tokenizer


def generation(name: str, *, snapshots: bool = True, prefix: CachedPrefix | None = None) -> EngineRequest:
    return EngineRequest(
        request_id=RequestId(name),
        prompt_tokens=PROMPT,
        sampling=SamplingParams(max_tokens=6, temperature=0),
        snapshots=snapshots,
        prefix=prefix,
    )


def run(engine: BatchEngine, request: EngineRequest) -> tuple[list[int], GenerationFinished]:
    outputs = engine.step([request], [])
    while engine.active:
        outputs += engine.step([], [])
    tokens = [token for o in outputs if isinstance(o.event, TokensGenerated) for token in o.event.token_ids]
    (finished,) = [o.event for o in outputs if isinstance(o.event, GenerationFinished)]
    return tokens, finished


def cancelled_after(engine: BatchEngine, request: EngineRequest, steps: int) -> list[EngineOutput]:
    """`request`'s outputs when it is cancelled after `steps` steps (each prefills one chunk)."""
    outputs = engine.step([request], [])
    for _ in range(steps - 1):
        outputs += engine.step([], [])
    outputs += engine.step([], [request.request_id])
    assert not engine.active
    return outputs


def kept(outputs: list[EngineOutput]) -> list[SnapshotTaken]:
    return [output.event for output in outputs if isinstance(output.event, SnapshotTaken)]


def test_the_state_prefilled_so_far_is_kept_and_a_resend_starts_from_it(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    from_scratch, _ = run(engine, generation("scratch", snapshots=False))
    (snapshot,) = kept(cancelled_after(engine, generation("gave-up"), steps=3))
    assert snapshot.origin is Origin.BOUNDARY
    assert snapshot.tokens == PROMPT[: 3 * CHUNK]  # the end of the last chunk it prefilled
    length = len(snapshot.tokens)
    resent = generation("resent", prefix=CachedPrefix(state=snapshot.state, length=length, matched=length))
    tokens, finished = run(engine, resent)
    assert tokens == from_scratch  # the kept state is the state after those tokens
    assert finished.cached_tokens == length


def test_nothing_is_kept_without_snapshots_or_before_a_chunk(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    assert kept(cancelled_after(engine, generation("opted-out", snapshots=False), steps=3)) == []
    assert kept(engine.step([generation("at-once")], [RequestId("at-once")])) == []  # admitted, nothing prefilled yet
    assert not engine.active


def test_what_a_snapshot_already_covers_is_not_kept_again(loaded: tuple[Any, Any]) -> None:
    """Cancelled once its prompt but the last token is prefilled: its boundary snapshot holds that state already."""
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = cancelled_after(engine, generation("nearly-done"), steps=len(PROMPT) // CHUNK + 1)
    assert [len(snapshot.tokens) for snapshot in kept(outputs)] == [len(PROMPT) - 1]  # that one only
