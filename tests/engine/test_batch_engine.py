"""BatchEngine on a real tiny model: batching, cancellation, and a failing forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from courier.core.failure_codes import FailureCode
from courier.core.step_planning.depth_costs import FixedDepthCosts, StepWork
from courier.core.step_planning.prefill_budget import MIN_CHUNK, PrefillBudget
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import (
    FinishReason,
    GenerationFailed,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
)
from courier.engine.model_state import CachedPrefix, compact_copy, prefill
from tests.support import tiny_models
from tests.support.device import STATE_ATOL, bitwise_across_shapes
from tests.support.faulty_model import FailingModel

LIMITS = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=64)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return tiny_models.load_float32(tiny_llama_dir)


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


def texts(outputs: list[EngineOutput]) -> dict[str, str]:
    collected: dict[str, str] = {}
    for output in outputs:
        if isinstance(output.event, TokensGenerated):
            collected[output.request_id] = collected.get(output.request_id, "") + output.event.text
    return collected


def test_a_transient_fault_replays_the_batch_and_loses_nothing(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    undisturbed = run_until_done(engine := BatchEngine(model, tokenizer, LIMITS), engine.step([request("x", 30)], []))
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS)
    outputs = engine.step([request("x", 30), request("y", 30, (9, 8, 7))], [])
    outputs += engine.step([], [])
    flaky.failures = 1
    outputs += engine.step([], [])  # fails; both are replayed alone and rejoin the batch
    assert engine.active == 2
    run_until_done(engine, outputs)
    ends = finished(outputs)
    assert all(isinstance(event, GenerationFinished) and event.completion_tokens == 30 for event in ends.values())
    assert set(ends) == {"x", "y"}
    assert texts(outputs)["x"] == texts(undisturbed)["x"]


def test_a_fault_that_follows_a_request_fails_it_alone(loaded: tuple[Any, Any]) -> None:
    """The batch step fails, then the replay of the first request fails too: that one is the culprit."""
    model, tokenizer = loaded
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS)
    outputs = engine.step([request("x", 20), request("y", 20)], [])
    flaky.failures = 2  # the batched step, then x's replay
    outputs += engine.step([], [])
    run_until_done(engine, outputs)
    ends = finished(outputs)
    assert isinstance(ends["x"], GenerationFailed) and "simulated kernel fault" in ends["x"].message
    assert isinstance(ends["y"], GenerationFinished) and ends["y"].completion_tokens == 20


def test_a_fault_right_after_a_recovery_fails_the_batch_and_the_engine_keeps_serving(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS)
    outputs = engine.step([request("x", 50), request("y", 50)], [])
    flaky.failures = 1
    outputs += engine.step([], [])  # replayed
    flaky.failures = 1
    outputs += engine.step([], [])  # fails again at once: no second replay
    failed = finished(outputs)
    assert set(failed) == {"x", "y"}
    assert all(isinstance(event, GenerationFailed) for event in failed.values())
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


# ---------------------------------------------------------------- in-batch shared prefixes

TOPICS = ("the ocean", "a lighthouse", "autumn leaves", "coffee")
CHAT_LIMITS = replace(LIMITS, prefill_step_size=16)  # several prefill chunks per prompt, as with long prompts
UNSHARED = replace(CHAT_LIMITS, shared_prefix_min_tokens=0)


def chat_request(tokenizer: Any, name: str, text: str, max_tokens: int = 12, **fields: Any) -> EngineRequest:
    """A chat prompt as the server builds it: the template's default system prompt, a history boundary."""
    messages = [{"role": "user", "content": text}]
    prompt = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    history = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    boundary = common_length([history, prompt])
    return EngineRequest(
        request_id=RequestId(name),
        prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        boundary=boundary,
        snapshots=True,
        **fields,
    )


def burst(tokenizer: Any, name: str, task: str) -> list[EngineRequest]:
    """One request per topic, named name0, name1, ..."""
    return [chat_request(tokenizer, f"{name}{n}", task.format(topic)) for n, topic in enumerate(TOPICS)]


def common_length(sequences: Sequence[Sequence[int]]) -> int:
    first, *others = sequences
    return next((i for i, token in enumerate(first) if any(i >= len(o) or o[i] != token for o in others)), len(first))


def run_all(engine: BatchEngine, requests: list[EngineRequest]) -> list[EngineOutput]:
    return run_until_done(engine, engine.step(requests, []))


def generated(outputs: list[EngineOutput]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for output in outputs:
        if isinstance(output.event, TokensGenerated):
            tokens.setdefault(output.request_id, []).extend(output.event.token_ids)
    return tokens


def snapshots(outputs: list[EngineOutput]) -> list[tuple[str, str, tuple[int, ...], int]]:
    return sorted(
        (o.request_id, o.event.origin.value, o.event.tokens, o.event.nbytes)
        for o in outputs
        if isinstance(o.event, SnapshotTaken)
    )


def shared_and_unshared(model: Any, tokenizer: Any, requests: list[EngineRequest]) -> tuple[Any, Any, list[int]]:
    """Outputs with and without in-batch sharing, and the batch-of-one prefills the sharing engine ran."""
    calls = CountingModel(model)
    shared = run_all(BatchEngine(calls, tokenizer, CHAT_LIMITS), requests)
    unshared = run_all(BatchEngine(model, tokenizer, UNSHARED), requests)
    return shared, unshared, calls.prefilled


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def family(request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen3_next_dir: Path) -> tuple[Any, Any]:
    return tiny_models.load_float32(tiny_llama_dir if request.param == "dense" else tiny_qwen3_next_dir)


def test_a_burst_sharing_a_system_prompt_generates_what_it_would_alone(family: tuple[Any, Any]) -> None:
    model, tokenizer = family
    requests = burst(tokenizer, "r", "Write a short poem about {}.")
    shared, unshared, prefilled = shared_and_unshared(model, tokenizer, requests)
    common = common_length([r.prompt_tokens for r in requests])
    assert common >= 24  # the template's system prompt and more
    assert prefilled == [common]  # once, at batch size one
    assert generated(shared) == generated(unshared)
    assert all(len(tokens) == 12 for tokens in generated(shared).values())
    # The same boundary and completion snapshots, of the same sizes.
    assert snapshots(shared) == snapshots(unshared)
    # Computed once for the batch, not served from the cache: not counted as cached.
    assert {event.cached_tokens for event in finished(shared).values()} == {0}


def test_a_shared_prefix_ending_at_the_history_boundary_still_gives_the_boundary_snapshot(
    family: tuple[Any, Any],
) -> None:
    model, tokenizer = family
    requests = [chat_request(tokenizer, f"same{n}", "Tell me about the moon.") for n in range(3)]
    boundary = requests[0].boundary
    shared, unshared, prefilled = shared_and_unshared(model, tokenizer, requests)
    assert prefilled == [boundary]
    assert generated(shared) == generated(unshared)
    assert snapshots(shared) == snapshots(unshared)
    assert ("same0", "boundary", requests[0].prompt_tokens[:boundary]) in [s[:3] for s in snapshots(shared)]


def test_requests_from_the_same_cached_prefix_share_what_follows_it(family: tuple[Any, Any]) -> None:
    model, tokenizer = family
    requests = burst(tokenizer, "c", "Give three fun facts about {}.")
    cached_tokens = 6
    state, _ = compact_copy(prefill(model, requests[0].prompt_tokens[:10]))
    # A dense snapshot covering 10 tokens, of which the prompts match 6 (trimmed), or an exact hybrid one.
    prefix = CachedPrefix(state=state, length=10, matched=10 if isinstance(state[0], ArraysCache) else cached_tokens)
    requests = [replace(r, prefix=prefix) for r in requests]
    shared, unshared, prefilled = shared_and_unshared(model, tokenizer, requests)
    assert prefilled == [common_length([r.prompt_tokens for r in requests]) - prefix.matched]
    assert generated(shared) == generated(unshared)
    assert snapshots(shared) == snapshots(unshared)
    assert {event.cached_tokens for event in finished(shared).values()} == {prefix.matched}


def test_a_burst_joining_a_running_batch_shares_at_most_one_prefill_chunk(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    requests = burst(tokenizer, "j", "Explain why people like {}.")

    def joined(engine: BatchEngine) -> list[EngineOutput]:
        outputs = engine.step([request("running", 8)], [])
        return run_until_done(engine, outputs + engine.step(requests, []))

    calls = CountingModel(model)
    shared = joined(BatchEngine(calls, tokenizer, CHAT_LIMITS))
    assert calls.prefilled == [CHAT_LIMITS.prefill_step_size]  # the running request waits for no more than that
    assert generated(shared) == generated(joined(BatchEngine(model, tokenizer, UNSHARED)))


def test_requests_arriving_later_start_from_the_shared_prefix_still_in_flight(family: tuple[Any, Any]) -> None:
    model, tokenizer = family
    haikus = burst(tokenizer, "h", "Write a haiku about {}.")
    first, same = haikus[:2], haikus[2]
    other = chat_request(tokenizer, "other", "Tell a very short story about jazz.")

    def staggered(engine: BatchEngine) -> list[EngineOutput]:
        outputs = engine.step(first, [])
        outputs += engine.step([same], [])  # one step later: the whole shared prefix is its own
        outputs += engine.step([other], [])  # agrees with it on the system prompt only
        return run_until_done(engine, outputs)

    calls = CountingModel(model)
    engine = BatchEngine(calls, tokenizer, CHAT_LIMITS)
    shared = staggered(engine)
    prefix = common_length([r.prompt_tokens for r in haikus])
    system = common_length([haikus[0].prompt_tokens, other.prompt_tokens])
    assert calls.prefilled == [prefix]  # once, for the first two
    # The generator prefilled everything else: a dense cache cut to the system prompt serves `other` too.
    other_start = system if isinstance(make_prompt_cache(model)[0], KVCache) else 0
    prompts = [len(r.prompt_tokens) - 1 for r in (*first, same, other)]
    assert engine._generator._counters.prompt_tokens == sum(prompts) - 3 * prefix - other_start
    unshared = staggered(BatchEngine(model, tokenizer, UNSHARED))
    assert generated(shared) == generated(unshared)
    assert snapshots(shared) == snapshots(unshared)
    assert {event.cached_tokens for event in finished(shared).values()} == {0}
    # Dropped with the last request that used it: a later burst prefills its prefix again.
    run_all(engine, haikus)
    assert calls.prefilled == [prefix, prefix]


def test_a_failing_shared_prefill_fails_only_the_requests_sharing_it(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, CHAT_LIMITS)
    sharing = burst(tokenizer, "s", "Describe {} in two sentences.")
    flaky.failures = 1  # the first forward pass of the step is the shared prefill
    outputs = run_all(engine, [*sharing, request("alone", 4)])
    ends = finished(outputs)
    assert all(isinstance(ends[f"s{n}"], GenerationFailed) for n in range(len(TOPICS)))
    assert "simulated kernel fault" in ends["s0"].message
    assert isinstance(ends["alone"], GenerationFinished) and ends["alone"].completion_tokens == 4
    again = run_all(engine, sharing)  # and the engine keeps serving, sharing again
    assert all(isinstance(event, GenerationFinished) for event in finished(again).values())


class CountingModel:
    """Wraps a real model and records the length of every prefill it runs outside the batch generator."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.prefilled: list[int] = []

    def __call__(self, inputs: Any, *args: Any, cache: Any = None, **kwargs: Any) -> Any:
        if cache is not None and any(type(layer) is KVCache for layer in cache):  # the generator's are batch caches
            self.prefilled.append(inputs.shape[1])
        return self._model(inputs, *args, cache=cache, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_dense_boundary_snapshot_is_cut_from_the_prompt_state_without_a_second_segment(
    loaded: tuple[Any, Any],
) -> None:
    model, tokenizer = loaded
    alone = chat_request(tokenizer, "alone", "What is the capital of France?")
    boundary, prompt = alone.boundary, alone.prompt_tokens
    outputs = run_all(BatchEngine(model, tokenizer, CHAT_LIMITS), [alone])
    taken = [o.event for o in outputs if isinstance(o.event, SnapshotTaken)]
    assert [(s.origin.value, len(s.tokens)) for s in taken[:2]] == [
        ("boundary", boundary),  # history first, as a two-segment prefill gives them
        ("boundary", len(prompt) - 1),
    ]
    assert taken[2].origin.value == "completion"
    cut = taken[0]
    assert cut.tokens == prompt[:boundary]
    expected, nbytes = compact_copy(prefill(model, prompt[:boundary]))
    assert cut.nbytes == nbytes
    for got, want in zip(cut.state, expected, strict=True):
        assert got.offset == want.offset == boundary
        assert mx.allclose(got.keys, want.keys, atol=STATE_ATOL).item()
        assert mx.allclose(got.values, want.values, atol=STATE_ATOL).item()


# ---------------------------------------------------------------- n samples of one prompt


def by_choice(outputs: list[EngineOutput]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for output in outputs:
        if isinstance(output.event, TokensGenerated):
            tokens.setdefault(output.event.choice, []).extend(output.event.token_ids)
    return tokens


def test_samples_of_one_prompt_prefill_it_once(family: tuple[Any, Any]) -> None:
    model, tokenizer = family
    alone = replace(chat_request(tokenizer, "alone", "Name a colour."), snapshots=False)
    samples = replace(alone, request_id=RequestId("samples"), n=3)
    calls = CountingModel(model)
    engine = BatchEngine(calls, tokenizer, CHAT_LIMITS)
    outputs = run_all(engine, [samples])
    assert calls.prefilled == [len(alone.prompt_tokens) - 1]  # once, outside the batch
    assert engine._generator._counters.prompt_tokens == 0  # each sample starts at the prompt's last token
    ends = [o.event for o in outputs if isinstance(o.event, GenerationFinished)]
    assert sorted(end.choice for end in ends) == [0, 1, 2]
    assert {(end.prompt_tokens, end.completion_tokens) for end in ends} == {(len(alone.prompt_tokens), 12)}
    single = generated(run_all(BatchEngine(model, tokenizer, CHAT_LIMITS), [alone]))["alone"]
    assert by_choice(outputs) == {0: single, 1: single, 2: single}  # greedy: every sample is the same reply


@bitwise_across_shapes
def test_seeded_samples_draw_from_their_own_seeds(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    base = replace(chat_request(tokenizer, "s", "Tell me a story."), snapshots=False)
    samples = run_all(BatchEngine(model, tokenizer, CHAT_LIMITS), [replace(base, sampling=sampling, n=3)])
    alone = [
        generated(
            run_all(BatchEngine(model, tokenizer, CHAT_LIMITS), [replace(base, sampling=replace(sampling, seed=s))])
        )
        for s in (7, 8, 9)
    ]
    drawn = by_choice(samples)
    assert [drawn[choice] for choice in range(3)] == [tokens["s"] for tokens in alone]
    assert len({tuple(tokens) for tokens in drawn.values()}) > 1  # they differ from one another


def test_samples_keep_the_conversations_boundary_snapshot_and_take_no_other(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    samples = replace(chat_request(tokenizer, "c", "What is the capital of France?"), n=2)
    outputs = run_all(BatchEngine(model, tokenizer, CHAT_LIMITS), [samples])
    taken = [o.event for o in outputs if isinstance(o.event, SnapshotTaken)]
    assert [(s.origin.value, s.tokens) for s in taken] == [("boundary", samples.prompt_tokens[: samples.boundary])]
    assert sorted(o.event.choice for o in outputs if isinstance(o.event, GenerationFinished)) == [0, 1]


def test_cancelling_a_request_of_samples_takes_them_all_out(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, LIMITS)
    engine.step([replace(request("many", 1000), n=3), request("one", 4)], [])
    assert engine.active == 4
    engine.step([], [RequestId("many")])
    assert engine.active == 1


def test_a_fault_replays_every_sample_and_each_carries_on(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    undisturbed = run_all(BatchEngine(model, tokenizer, LIMITS), [replace(request("x", 20), n=2)])
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS)
    outputs = engine.step([replace(request("x", 20), n=2)], [])
    outputs += engine.step([], [])
    flaky.failures = 1
    outputs += engine.step([], [])  # fails; both samples are replayed alone and rejoin the batch
    run_until_done(engine, outputs)
    assert by_choice(outputs) == by_choice(undisturbed)
    assert sorted(o.event.choice for o in outputs if isinstance(o.event, GenerationFinished)) == [0, 1]


def test_a_request_past_its_deadline_ends_as_a_length_cut_with_what_it_wrote(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    whole = run_until_done(engine := BatchEngine(model, tokenizer, LIMITS), engine.step([request("x", 40)], []))
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = engine.step([request("x", 40), request("y", 6, (9, 8, 7))], [])
    for _ in range(4):
        outputs += engine.step([], [])
    outputs += engine.step([], [], [RequestId("x")])
    assert engine.active <= 1  # "y" may have finished; "x" has left
    run_until_done(engine, outputs)
    ends = finished(outputs)
    cut = ends["x"]
    assert isinstance(cut, GenerationFinished) and cut.reason is FinishReason.LENGTH and cut.deadline
    assert 0 < cut.completion_tokens < 40
    assert texts(whole)["x"].startswith(texts(outputs)["x"])  # what it wrote, none of it lost
    assert isinstance(ends["y"], GenerationFinished) and not ends["y"].deadline and ends["y"].completion_tokens == 6


def test_a_request_past_its_deadline_before_its_first_token_fails_as_timed_out(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    engine = BatchEngine(model, tokenizer, BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=16))
    outputs = engine.step([request("long", 8, tuple(range(10, 200)))], [])  # a prefill of several steps
    assert not [o for o in outputs if isinstance(o.event, TokensGenerated)]
    outputs += engine.step([], [], [RequestId("long")])
    failed = finished(outputs)["long"]
    assert isinstance(failed, GenerationFailed) and failed.code is FailureCode.DEADLINE_EXCEEDED
    assert engine.active == 0


def steps_to_first_token(engine: BatchEngine, name: str) -> tuple[int, list[EngineOutput]]:
    outputs: list[EngineOutput] = []
    for step in range(1, 100):
        outputs += engine.step([], [])
        if any(o.request_id == name and isinstance(o.event, TokensGenerated) for o in outputs):
            return step, outputs
    raise AssertionError("no first token")


def test_a_long_prompt_beside_decoding_streams_is_prefilled_in_budgeted_chunks(loaded: tuple[Any, Any]) -> None:
    """A budget too small for any chunk holds each step's prefill to the smallest chunk while streams decode; with
    no budget a prompt takes whole --prefill-step-size chunks. The text is the same."""
    model, tokenizer = loaded
    long_prompt = tuple(range(10, 310))  # 300 tokens: a budgeted step prefills 32 of them
    texts_by_budget, steps_by_budget = [], []
    for stall_s in (0.0, 1e-9):
        limits = BatchLimits(
            max_batch=4,
            prefill_batch=4,
            prefill_step_size=512,
            prefill_stall_s=stall_s,
            prefill_costs=lambda: FixedDepthCosts(0.1, 0.01),  # a pinned machine: the budget holds no token
        )
        engine = BatchEngine(model, tokenizer, limits)
        outputs = engine.step([request("a", 200), request("b", 200, (5, 6, 7))], [])
        outputs += engine.step([], [])  # both decode now
        outputs += engine.step([request("long", 4, long_prompt)], [])
        steps, later = steps_to_first_token(engine, "long")
        steps_by_budget.append(steps)
        run_until_done(engine, outputs := outputs + later)
        texts_by_budget.append(texts(outputs))
        assert all(isinstance(event, GenerationFinished) for event in finished(outputs).values())
    assert texts_by_budget[0] == texts_by_budget[1]
    unbudgeted, budgeted = steps_by_budget
    assert budgeted - unbudgeted == 9  # 299 tokens before the first: one chunk of 512, or ten of 32


def test_a_request_arriving_beside_a_long_prompt_alone_answers_before_that_prompt_is_prefilled(
    loaded: tuple[Any, Any],
) -> None:
    """With nothing decoding a long prompt is prefilled in budgeted chunks too, so a short request that arrives after
    its first step joins at the next one and finishes while the long prompt is still being prefilled; with no
    budget the whole prompt goes in one step and the short request comes after it. The texts are the same."""
    model, tokenizer = loaded
    long_prompt = tuple(range(10, 510))  # 500 tokens: 16 budgeted chunks of 32, or one step of 512
    texts_by_budget, long_first_by_budget = [], []
    for stall_s in (0.0, 1e-9):
        limits = BatchLimits(
            max_batch=4,
            prefill_batch=4,
            prefill_step_size=512,
            prefill_stall_s=stall_s,
            prefill_costs=lambda: FixedDepthCosts(0.1, 0.01),  # a pinned machine: the budget holds no token
        )
        engine = BatchEngine(model, tokenizer, limits)
        outputs = engine.step([request("long", 4, long_prompt)], [])  # alone: nothing decodes
        outputs += engine.step([request("short", 2, (5, 6, 7))], [])
        for _ in range(10):
            if "short" in finished(outputs):
                break
            outputs += engine.step([], [])
        long_first_by_budget.append(
            any(o.request_id == "long" and isinstance(o.event, TokensGenerated) for o in outputs)
        )
        run_until_done(engine, outputs)
        texts_by_budget.append(texts(outputs))
        assert all(isinstance(event, GenerationFinished) for event in finished(outputs).values())
    assert texts_by_budget[0] == texts_by_budget[1]
    assert long_first_by_budget == [True, False]  # budgeted, "short" finished first, within 10 steps of arriving


def test_a_long_prompt_is_prefilled_in_smaller_chunks_the_deeper_it_gets(loaded: tuple[Any, Any]) -> None:
    """On a pinned machine where attending costs, each chunk of a long prompt is the largest whose cost at the depth
    the prompt has reached fits the budget: the chunks shrink as the prompt deepens, down to the smallest chunk."""
    model, tokenizer = loaded
    costs = FixedDepthCosts(0.1, 1e-4, 2e-6)
    limits = BatchLimits(
        max_batch=4, prefill_batch=4, prefill_step_size=512, prefill_stall_s=0.02, prefill_costs=lambda: costs
    )
    engine = BatchEngine(model, tokenizer, limits)
    prompt = tuple(range(10, 510))
    outputs = engine.step([request("long", 2, prompt)], [])
    chunks = [engine._generator.prefill_step_size]
    while not any(o.request_id == "long" and isinstance(o.event, TokensGenerated) for o in outputs):
        outputs += engine.step([], [])
        chunks.append(engine._generator.prefill_step_size)
    budget = PrefillBudget(stall_s=0.02, largest=512, costs=costs)
    depth, sized = 0, []
    while depth < len(prompt) - 1:  # all but its last token are prefilled in chunks; that one starts its decoding
        sized.append(budget.chunk(StepWork(prefill_depths=[depth])))
        depth += sized[-1]
    assert chunks[: len(sized)] == sized
    assert sized[0] > sized[1] > sized[2] > MIN_CHUNK
    assert sized[-1] == MIN_CHUNK
    run_until_done(engine, outputs)


def test_the_step_admitting_prompts_is_estimated_by_the_cost_model_its_chunks_are_sized_with(
    loaded: tuple[Any, Any],
) -> None:
    """What an idle scheduler asks before it waits for a burst (`--admission-window-ms`): a prompt's first chunk,
    as the budget sizes it at its cached depth, priced by the same model; a short rest is priced as what it is."""
    model, tokenizer = loaded
    costs = FixedDepthCosts(0.1, 1e-4, 2e-6)
    limits = BatchLimits(
        max_batch=4, prefill_batch=4, prefill_step_size=512, prefill_stall_s=0.02, prefill_costs=lambda: costs
    )
    engine = BatchEngine(model, tokenizer, limits)
    budget = PrefillBudget(stall_s=0.02, largest=512, costs=costs)
    model_costs = costs.model()
    cold = StepWork(prefill_depths=[0])
    chunk = budget.chunk(cold)
    assert 8 < chunk < 500
    assert engine.admission_seconds([(0, 500)]) == model_costs.estimate(cold.positions(chunk), cold.attended(chunk))
    cached = StepWork(prefill_depths=[1000])
    assert engine.admission_seconds([(1000, 8)]) == model_costs.estimate(cached.positions(8), cached.attended(8))
    assert engine.admission_seconds([(1000, 8)]) < engine.admission_seconds([(0, 500)])
    pair = StepWork(prefill_depths=[0, 1000])
    both = min(budget.chunk(pair), 500)
    assert engine.admission_seconds([(0, 500), (1000, 8)]) == model_costs.estimate(
        pair.positions(both), pair.attended(both)
    )
    assert engine.admission_seconds([]) == 0.0


def tenant_of(origin: object) -> object:
    assert isinstance(origin, tuple)
    return origin[0]


def test_requests_of_different_tenants_never_share_a_prefix_prefilled_in_the_batch(family: tuple[Any, Any]) -> None:
    """The same system prompt sent under two API keys is prefilled once per key: a prefix shared across keys would
    let one key learn, from its first token's time, what another key is sending."""
    model, tokenizer = family
    system = tuple(range(100, 180))
    requests = [
        replace(request(name, 3, (*system, 7, index)), tenant=tenant)
        for index, (name, tenant) in enumerate((("a1", "key-a"), ("a2", "key-a"), ("b1", "key-b")))
    ]
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = engine.step(requests[:2], [])  # one key's two requests: their common prefix prefilled once
    assert [tenant_of(state.key.origin) for state in engine._admission.shared] == ["key-a"]
    outputs += engine.step(requests[2:], [])  # another key's request: it starts on its own, from nothing shared
    assert [tenant_of(state.key.origin) for state in engine._admission.shared] == ["key-a"]
    assert all(sequence.shared is None for sequence in engine._sequences if sequence.request.tenant == "key-b")
    run_until_done(engine, outputs)
    assert set(finished(outputs)) == {"a1", "a2", "b1"}
