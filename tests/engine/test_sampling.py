"""Samplers at the edges of every field, and a sampler fault that fails its own sequence only.

The filters are checked on small hand-made distributions; the engine tests run the tiny llama, with the fault
that once broke every client: mlx-lm's compiled `top_k` filter raising for a `top_k` at the vocabulary, which
left MLX's global random state holding a traced array.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import greedy_sampler, make_sampler

from courier.engine import admission
from courier.engine import sampling as sampling_module
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest
from courier.engine.generation import GenerationFailed, GenerationFinished, RequestId, SamplingParams, TokensGenerated
from courier.engine.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    Filters,
    RandomSampler,
    Sampler,
    SeededSampler,
    build_sampler,
    keep_min_p,
    keep_top_k,
    keep_top_p,
    probe,
)
from tests.support import tiny_models

LIMITS = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=64)
# log-probabilities of a 5-token vocabulary: 0.5, 0.25, 0.125, 0.0625, 0.0625
DISTRIBUTION = mx.log(mx.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))


def kept(logprobs: mx.array) -> list[int]:
    values = cast("list[float]", logprobs[0].tolist())
    return [index for index, value in enumerate(values) if value != -math.inf]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(1e-300, [0]), (5e-324, [0]), (0.1, [0]), (0.5, [0]), (0.6, [0, 1]), (0.8, [0, 1, 2]), (1.0, [0, 1, 2, 3, 4])],
)
def test_top_p_keeps_the_smallest_head_reaching_its_mass_and_never_nothing(top_p: float, expected: list[int]) -> None:
    assert kept(keep_top_p(DISTRIBUTION, top_p)) == expected


def test_top_p_reads_an_unnormalised_distribution_by_its_own_mass() -> None:
    masked = DISTRIBUTION + mx.array([[0.0, 0.0, -mx.inf, -mx.inf, -mx.inf]])  # a grammar's mask, not renormalised
    assert kept(keep_top_p(masked, 0.6)) == [0]
    assert kept(keep_top_p(masked, 0.7)) == [0, 1]


@pytest.mark.parametrize(
    ("min_p", "expected"), [(1.0, [0]), (0.5, [0, 1]), (0.2, [0, 1, 2]), (1e-300, [0, 1, 2, 3, 4])]
)
def test_min_p_keeps_tokens_near_the_top_and_at_one_only_the_top(min_p: float, expected: list[int]) -> None:
    assert kept(keep_min_p(DISTRIBUTION, min_p)) == expected


@pytest.mark.parametrize(("top_k", "expected"), [(1, [0]), (2, [0, 1]), (4, [0, 1, 2, 3]), (5, None), (10**6, None)])
def test_top_k_at_or_past_the_vocabulary_keeps_everything(top_k: int, expected: list[int] | None) -> None:
    result = kept(keep_top_k(DISTRIBUTION, top_k))
    if expected is None:
        assert result == [0, 1, 2, 3, 4]
    else:
        assert sorted(result) == expected


def token(drawn: mx.array) -> int:
    return cast("int", drawn.item())


def sampling(**fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=1, **fields)


@pytest.mark.parametrize("temperature", [0.0, 5e-324, sys.float_info.min, 1e-300, 1e-45, GREEDY_BELOW_TEMPERATURE / 2])
def test_a_temperature_under_the_threshold_is_greedy_seeded_or_not(temperature: float) -> None:
    assert build_sampler(sampling(temperature=temperature)) is greedy_sampler
    assert build_sampler(sampling(temperature=temperature, seed=3)) is greedy_sampler


def test_top_k_one_is_greedy_and_other_values_sample() -> None:
    assert build_sampler(sampling(temperature=1.0, top_k=1)) is greedy_sampler
    assert isinstance(build_sampler(sampling(temperature=1.0, top_k=49152)), RandomSampler)
    assert isinstance(build_sampler(sampling(temperature=1.0, seed=1)), SeededSampler)


@pytest.mark.parametrize(
    "fields", [{"temperature": -1.0}, {"temperature": math.nan}, {"top_p": 0.0}, {"min_p": 1.5}, {"top_k": -1}]
)
def test_values_no_request_may_carry_are_refused_when_the_sampler_is_built(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        build_sampler(sampling(**{"temperature": 1.0, **fields}))


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": GREEDY_BELOW_TEMPERATURE, "top_p": 1e-300},
        {"temperature": 2.0, "min_p": 1.0},
        {"temperature": GREEDY_BELOW_TEMPERATURE * 2},
        {"temperature": 2.0, "top_p": 5e-324, "seed": 7},
    ],
)
def test_samplers_at_the_edges_draw_the_top_token(fields: dict[str, Any]) -> None:
    sampler = build_sampler(sampling(**fields))
    logprobs = mx.log(mx.softmax(mx.array([[3.0, 9.0, 1.0, -2.0]]) * 4, axis=-1))
    assert {token(sampler(logprobs)) for _ in range(20)} == {1}


def test_a_low_precision_distribution_is_scaled_without_overflow() -> None:
    sampler = RandomSampler(GREEDY_BELOW_TEMPERATURE * 2, Filters())
    logprobs = mx.log(mx.softmax(mx.array([[3.0, 9.0, 1.0, -2.0]]), axis=-1)).astype(mx.float16)
    assert token(sampler(logprobs)) == 1


def test_a_probe_draws_without_moving_a_seeded_stream() -> None:
    sampler = SeededSampler(11, 1.0)
    sampler.position = 5
    probe(sampler, DISTRIBUTION)
    assert sampler.position == 5


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return tiny_models.load_float32(tiny_llama_dir)


def request(name: str, **fields: Any) -> EngineRequest:
    params = SamplingParams(max_tokens=12, **{"temperature": 1.0, **fields})
    return EngineRequest(request_id=RequestId(name), prompt_tokens=(1, 2, 3, 4, 5), sampling=params)


def run(engine: BatchEngine, added: list[EngineRequest]) -> list[EngineOutput]:
    outputs = engine.step(added, [])
    for _ in range(100):
        if not engine.active:
            break
        outputs.extend(engine.step([], []))
    return outputs


def ends(outputs: list[EngineOutput]) -> dict[str, Any]:
    return {o.request_id: o.event for o in outputs if isinstance(o.event, GenerationFinished | GenerationFailed)}


def greedy_tokens(outputs: list[EngineOutput], name: str) -> list[int]:
    return [
        t for o in outputs if o.request_id == name and isinstance(o.event, TokensGenerated) for t in o.event.token_ids
    ]


def test_a_sampler_that_breaks_the_random_state_fails_its_sequence_alone(
    loaded: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The culprit samples with mlx-lm's compiled filter at `top_k` = vocabulary, which raises mid-trace and leaves
    the global random state broken; it fails alone, the batch it shared carries on, and unseeded sampling after it
    works (before the fix every later unseeded request failed)."""
    model, tokenizer = loaded
    real = sampling_module.build_sampler

    def building(params: SamplingParams) -> Sampler:
        if params.top_k == 777:  # the culprit's marker
            return make_sampler(temp=1.0, top_k=int(model.args.vocab_size))  # type: ignore[no-any-return]
        return real(params)

    monkeypatch.setattr(admission, "build_sampler", building)
    engine = BatchEngine(model, tokenizer, LIMITS)
    outputs = run(engine, [request("plain"), request("seeded", seed=4), request("culprit", top_k=777)])
    finished = ends(outputs)
    assert isinstance(finished["culprit"], GenerationFailed)
    assert "top_k" in finished["culprit"].message
    assert all(isinstance(finished[name], GenerationFinished) for name in ("plain", "seeded"))
    assert all(finished[name].completion_tokens == 12 for name in ("plain", "seeded"))
    after = ends(run(engine, [request("later"), request("later-seeded", seed=9, top_p=0.9)]))
    assert all(isinstance(event, GenerationFinished) for event in after.values()), after


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-45},
        {"temperature": sys.float_info.min, "seed": 5},
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1.5, "min_p": 1.0},
        {"temperature": 1.5, "top_k": 1, "seed": 2},
    ],
)
def test_edge_sampling_in_the_batch_writes_the_greedy_reply(loaded: tuple[Any, Any], fields: dict[str, Any]) -> None:
    model, tokenizer = loaded
    greedy = greedy_tokens(run(BatchEngine(model, tokenizer, LIMITS), [request("g", temperature=0.0)]), "g")
    edge = greedy_tokens(run(BatchEngine(model, tokenizer, LIMITS), [request("e", **fields)]), "e")
    assert edge == greedy
