"""The batch engine with quantized prompt-cache snapshots (8-bit, group 64) on tiny dense and hybrid models with
64-dimension heads: rows restored from quantized, full-precision and no snapshots share a batch, drafts are verified
and `n` samples fork from a restored quantized state, each generating what it would at full precision; every
snapshot the engine hands the store is quantized and charged as such."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.step_planning.prompt_lookup import LookupLimits
from courier.core.step_planning.verify_width import FixedCosts
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import GenerationFinished, RequestId, SamplingParams, TokensGenerated
from courier.engine.model_state import CachedPrefix, compact_copy, prefill, state_arrays
from courier.engine.warm_up import WarmUp
from tests.support import tiny_models

EIGHT = KvQuantization(8)
PLAIN = BatchLimits(max_batch=8, prefill_batch=8, prefill_step_size=64)
QUANTIZED = replace(PLAIN, snapshot_quantization=EIGHT)
SPECULATIVE = replace(
    QUANTIZED, speculation=LookupLimits(max_ngram=4, max_draft=8), step_costs=lambda: FixedCosts(1.0, 0.001)
)
TEXTS = ("Tell me about the moon.", "Write a poem about a cat.", "List three colours, then list them again.")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def wide(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    build = tiny_models.build_wide_llama if request.param == "dense" else tiny_models.build_wide_qwen3_next
    return load(str(build(smollm2_dir, tmp_path_factory.mktemp(f"wide-batch-{request.param}"))))[:2]


def chat(tokenizer: Any, name: str, text: str, *, max_tokens: int = 24, **fields: Any) -> EngineRequest:
    messages = [{"role": "user", "content": text}]
    prompt = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    history = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    boundary = next(i for i, token in enumerate(prompt) if i >= len(history) or history[i] != token)
    return EngineRequest(
        request_id=RequestId(name),
        prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        boundary=boundary,
        snapshots=True,
        **fields,
    )


def run(model: Any, tokenizer: Any, limits: BatchLimits, requests: list[EngineRequest]) -> list[EngineOutput]:
    return run_on(BatchEngine(model, tokenizer, limits), requests)


def run_on(engine: BatchEngine, requests: list[EngineRequest]) -> list[EngineOutput]:
    outputs = engine.step(requests, [])
    for _ in range(500):
        if not engine.active:
            break
        outputs.extend(engine.step([], []))
    return outputs


def tokens_of(outputs: list[EngineOutput]) -> dict[tuple[str, int], list[int]]:
    found: dict[tuple[str, int], list[int]] = {}
    for output in outputs:
        if isinstance(output.event, TokensGenerated):
            found.setdefault((output.request_id, output.event.choice), []).extend(output.event.token_ids)
    return found


def cached(outputs: list[EngineOutput]) -> dict[str, int]:
    return {o.request_id: o.event.cached_tokens for o in outputs if isinstance(o.event, GenerationFinished)}


def prefix(model: Any, prompt: tuple[int, ...], length: int, quantization: KvQuantization | None) -> CachedPrefix:
    """A stored snapshot of the prompt's first `length` tokens (an exact prefix: any model can start from it)."""
    state, _ = compact_copy(prefill(model, prompt[:length]), quantization=quantization)
    return CachedPrefix(state=state, length=length, matched=length)


def assert_quantized(taken: SnapshotTaken) -> None:
    kinds = {type(layer) for layer in taken.state}
    assert QuantizedKVCache in kinds and KVCache not in kinds
    assert taken.nbytes == sum(array.nbytes for layer in taken.state for array in state_arrays(layer))


def test_rows_restored_from_quantized_full_and_no_snapshots_share_a_batch(wide: Any) -> None:
    model, tokenizer = wide
    quantized, full, cold = (chat(tokenizer, name, text) for name, text in zip("qfc", TEXTS, strict=True))
    quantized = replace(quantized, prefix=prefix(model, quantized.prompt_tokens, quantized.boundary, EIGHT))
    full = replace(full, prefix=prefix(model, full.prompt_tokens, full.boundary, None))
    batch = run(model, tokenizer, QUANTIZED, [quantized, full, cold])
    alone = {}
    for request in (quantized, full, cold):
        alone.update(tokens_of(run(model, tokenizer, PLAIN, [replace(request, prefix=None)])))
    assert tokens_of(batch) == alone  # 8 bits: each row writes what it would at full precision, from scratch
    assert cached(batch) == {"q": quantized.boundary, "f": full.boundary, "c": 0}
    taken = [o.event for o in batch if isinstance(o.event, SnapshotTaken)]
    assert {(o.request_id, o.event.origin.value) for o in batch if isinstance(o.event, SnapshotTaken)} >= {
        ("q", "completion"),
        ("f", "completion"),
        ("c", "completion"),
    }
    for snapshot in taken:
        assert_quantized(snapshot)


def test_drafts_verified_after_a_quantized_restore_change_nothing(wide: Any) -> None:
    model, tokenizer = wide
    request = chat(tokenizer, "s", "one two three one two three one two three one two three", max_tokens=48)
    request = replace(request, prefix=prefix(model, request.prompt_tokens, request.boundary, EIGHT))
    engine = BatchEngine(model, tokenizer, SPECULATIVE)
    if not engine.speculating:
        pytest.skip("a hybrid model does not speculate (its cache cannot take positions back)")
    plain = run(model, tokenizer, QUANTIZED, [request])
    speculative = run_on(engine, [request])
    assert engine.speculation.drafted > 0
    assert tokens_of(speculative) == tokens_of(plain) == tokens_of(run(model, tokenizer, PLAIN, [request]))
    snapshots = [o.event for o in speculative if isinstance(o.event, SnapshotTaken)]
    assert snapshots
    for snapshot in snapshots:
        assert_quantized(snapshot)


def test_samples_fork_from_a_restored_quantized_state(wide: Any) -> None:
    model, tokenizer = wide
    single = chat(tokenizer, "one", TEXTS[0], max_tokens=16)
    samples = replace(single, request_id=RequestId("n"), n=3)
    samples = replace(samples, prefix=prefix(model, samples.prompt_tokens, samples.boundary, EIGHT))
    outputs = run(model, tokenizer, QUANTIZED, [samples])
    expected = tokens_of(run(model, tokenizer, PLAIN, [single]))[("one", 0)]
    assert tokens_of(outputs) == {("n", choice): expected for choice in range(3)}  # greedy: the same reply, thrice
    assert cached(outputs) == {"n": samples.boundary}


def test_an_idle_warm_up_stores_its_snapshot_quantized(wide: Any) -> None:
    model, tokenizer = wide
    request = chat(tokenizer, "w", TEXTS[1])
    tokens = (*request.prompt_tokens, 11, 12, 13)
    job = WarmUp(model, tokens, prefix(model, request.prompt_tokens, request.boundary, EIGHT), EIGHT)
    while not job.finished:
        job.advance()
    taken = job.snapshot()
    assert taken.tokens == tokens
    assert_quantized(taken)
    assert {layer.offset for layer in taken.state if isinstance(layer, QuantizedKVCache)} == {len(tokens)}


def test_a_request_cancelled_mid_prefill_keeps_its_state_quantized(wide: Any) -> None:
    model, tokenizer = wide
    prompt = tuple(range(10, 10 + 3 * PLAIN.prefill_step_size + 7))
    request = EngineRequest(
        request_id=RequestId("gave-up"),
        prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=6, temperature=0),
        snapshots=True,
    )
    engine = BatchEngine(model, tokenizer, QUANTIZED)
    outputs = engine.step([request], [])
    outputs += engine.step([], [])
    outputs += engine.step([], [request.request_id])
    (kept,) = [output.event for output in outputs if isinstance(output.event, SnapshotTaken)]
    assert_quantized(kept)
    length = len(kept.tokens)
    prefix = CachedPrefix(state=kept.state, length=length, matched=length)
    resent = replace(request, request_id=RequestId("resent"), prefix=prefix)
    from_scratch = tokens_of(run(model, tokenizer, PLAIN, [replace(request, snapshots=False)]))
    assert tokens_of(run(model, tokenizer, QUANTIZED, [resent]))[("resent", 0)] == from_scratch[("gave-up", 0)]
