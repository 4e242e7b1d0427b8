"""The batch engine with the running batch's attention KV quantized (`--kv-bits`) on tiny dense and hybrid models
with 64-dimension heads: greedy replies drift from full precision's within bounds (8 and 4 bits); continuous
batching, rows restored from snapshots (quantized, full and none) beside each other, drafts verified and taken back
per row, and `n` samples forked each give what a quantized batch gives the row alone and without drafts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.step_planning.prompt_lookup import LookupLimits
from courier.core.step_planning.verify_width import FixedCosts
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import RequestId
from courier.engine.quantized_batch_cache import BatchQuantizedKVCache
from tests.engine.test_quantized_batch import cached, chat, prefix, run_on, tokens_of
from tests.support import tiny_models

EIGHT, FOUR = KvQuantization(8), KvQuantization(4, group_size=32)
PLAIN = BatchLimits(max_batch=8, prefill_batch=8, prefill_step_size=64)
KV8 = replace(PLAIN, kv_quantization=EIGHT)
SPECULATIVE_KV8 = replace(
    KV8, speculation=LookupLimits(max_ngram=4, max_draft=8), step_costs=lambda: FixedCosts(1.0, 0.001)
)
TEXTS = (
    "Tell me about the moon.",
    "Write a poem about a cat.",
    "List three colours, then list them again.",
    "one two three one two three one two three one two three",
    "What is the capital of France?",
)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def wide(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    build = tiny_models.build_wide_llama if request.param == "dense" else tiny_models.build_wide_qwen3_next
    return load(str(build(smollm2_dir, tmp_path_factory.mktemp(f"wide-kv-bits-{request.param}"))))[:2]


class Watched(BatchEngine):
    """The engine, noting after each step which cache classes its generation batch runs with."""

    seen: set[type]

    def step(self, *args: Any, **kwargs: Any) -> list[EngineOutput]:
        outputs = super().step(*args, **kwargs)
        batch = self._generator._generation_batch
        self.seen = getattr(self, "seen", set()) | {type(layer) for layer in batch.prompt_cache}
        return outputs


def run(model: Any, tokenizer: Any, limits: BatchLimits, requests: list[EngineRequest]) -> tuple[Watched, Any]:
    engine = Watched(model, tokenizer, limits)
    return engine, run_on(engine, requests)


def requests(tokenizer: Any, max_tokens: int = 24) -> list[EngineRequest]:
    return [chat(tokenizer, f"r{index}", text, max_tokens=max_tokens) for index, text in enumerate(TEXTS)]


@pytest.mark.parametrize(("quantization", "least_share"), [(EIGHT, 0.75), (FOUR, 0.25)], ids=["8-bit", "4-bit"])
def test_greedy_drift_from_full_precision_stays_bounded(
    wide: Any, quantization: KvQuantization, least_share: float
) -> None:
    """Random tiny weights leave near-ties a quantized key can tip (SmolLM2's Q4_1 weights too: at 8 bits one of
    these five replies leaves full precision's after 23 tokens), so equality is not asserted: on average each reply
    keeps at least `least_share` of full precision's reply before it first differs, and recurrent layers stay exact."""
    model, tokenizer = wide
    engine, quantized = run(model, tokenizer, replace(PLAIN, kv_quantization=quantization), requests(tokenizer, 32))
    _, full = run(model, tokenizer, PLAIN, requests(tokenizer, 32))
    assert BatchQuantizedKVCache in engine.seen  # the running batch's attention KV was quantized
    if any(isinstance(layer, ArraysCache) for layer in make_prompt_cache(model)):
        assert ArraysCache in engine.seen
    got, want = tokens_of(quantized), tokens_of(full)
    assert got.keys() == want.keys()
    shares = [_common_prefix(got[key], want[key]) / len(want[key]) for key in want]
    assert sum(shares) / len(shares) >= least_share, shares


def test_rows_join_a_running_quantized_batch(wide: Any) -> None:
    """Continuous batching: requests admitted while others decode join the quantized batch, and each reply is the
    one it gets alone in a quantized batch (a position's packed values do not depend on its neighbours)."""
    model, tokenizer = wide
    first, *later = requests(tokenizer, 20)
    engine = Watched(model, tokenizer, KV8)
    outputs = engine.step([first], [])
    for request in later:
        for _ in range(3):
            outputs += engine.step([], [])
        outputs += engine.step([request], [])
    outputs += run_on(engine, [])
    alone: dict[tuple[str, int], list[int]] = {}
    for request in (first, *later):
        alone.update(tokens_of(run(model, tokenizer, KV8, [request])[1]))
    assert BatchQuantizedKVCache in engine.seen
    assert tokens_of(outputs) == alone


def test_restored_rows_of_every_kind_share_a_quantized_batch(wide: Any) -> None:
    model, tokenizer = wide
    quantized, full, cold = requests(tokenizer)[:3]
    quantized = replace(quantized, prefix=prefix(model, quantized.prompt_tokens, quantized.boundary, EIGHT))
    full = replace(full, prefix=prefix(model, full.prompt_tokens, full.boundary, None))
    engine, batch = run(model, tokenizer, replace(KV8, snapshot_quantization=EIGHT), [quantized, full, cold])
    alone: dict[tuple[str, int], list[int]] = {}
    for request in (quantized, full, cold):
        alone.update(tokens_of(run(model, tokenizer, KV8, [replace(request, prefix=None)])[1]))
    assert BatchQuantizedKVCache in engine.seen
    assert tokens_of(batch) == alone  # each as from scratch in a quantized batch, whatever it was restored from
    assert cached(batch) == {quantized.request_id: quantized.boundary, full.request_id: full.boundary, "r2": 0}
    completions = [
        o.event for o in batch if isinstance(o.event, SnapshotTaken) and o.event.origin.value == "completion"
    ]
    assert len(completions) == 3
    for taken in completions:  # a completion's state, cut from the quantized batch, resumes as a plain prefix
        assert KVCache not in {type(layer) for layer in taken.state}


def test_drafts_taken_back_per_row_in_a_quantized_batch(wide: Any) -> None:
    """Rows that keep different numbers of draft tokens: the per-row take-back on packed values changes nothing."""
    model, tokenizer = wide
    engine = Watched(model, tokenizer, SPECULATIVE_KV8)
    if not engine.speculating:
        pytest.skip("a hybrid model does not speculate (its cache cannot take positions back)")
    batch = requests(tokenizer, 48)
    outputs = run_on(engine, batch)
    assert engine.speculation.drafted > engine.speculation.accepted > 0  # some drafts kept, some taken back
    assert BatchQuantizedKVCache in engine.seen
    assert tokens_of(outputs) == tokens_of(run(model, tokenizer, KV8, batch)[1])  # as without drafts


def test_samples_fork_in_a_quantized_batch(wide: Any) -> None:
    model, tokenizer = wide
    single = chat(tokenizer, "one", TEXTS[0], max_tokens=16)
    samples = replace(single, request_id=RequestId("n"), n=3)
    engine, outputs = run(model, tokenizer, KV8, [samples])
    expected = tokens_of(run(model, tokenizer, KV8, [single])[1])[("one", 0)]
    assert BatchQuantizedKVCache in engine.seen
    assert tokens_of(outputs) == {("n", choice): expected for choice in range(3)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((index for index, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
