"""Multi-token decode steps in the batch engine: the same requests run with and without prompt-lookup drafts.

Lossless is the claim under test: at temperature 0 the text, finish, token counts and logprobs are those of the
engine without drafts, for single streams and mixed batches, on a tiny random llama (fast, loops often, so its
drafts are often right and sometimes wrong) and on the real SmolLM2 copying code; seeded sampling gives the same
text too (keys are kept per token); unseeded sampling keeps its distribution (a chi-square test on a tiny model).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from courier.core.step_planning.prompt_lookup import LookupLimits
from courier.core.step_planning.verify_width import FixedCosts
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import FinishReason, GenerationFinished, RequestId, SamplingParams, TokensGenerated
from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import json_schema
from courier.model.loader import load_model
from courier.model.progress import Progress
from courier.model.source import resolve_model_source
from tests.support import tiny_models
from tests.support.device import LOGPROB_ABS, bitwise_across_shapes
from tests.support.faulty_model import FailingModel
from tests.support.grammar import VOCAB_SIZE

PLAIN = BatchLimits(max_batch=8, prefill_batch=8, prefill_step_size=64)
# Drafts verified whenever there are some (a dispatch-bound cost line): the tiny model's passes are so cheap that a
# fitted line would often find a verify not worth it, and these tests are about what a verify does.
SPECULATIVE = replace(
    PLAIN, speculation=LookupLimits(max_ngram=4, max_draft=8), step_costs=lambda: FixedCosts(1.0, 0.001)
)


@dataclass
class Outcome:
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: Any = None
    snapshots: tuple[tuple[int, ...], ...] = ()


def run(
    model: Any,
    tokenizer: Any,
    limits: BatchLimits,
    requests: list[EngineRequest],
    grammars: GrammarCompiler | None = None,
) -> tuple[dict[str, Outcome], BatchEngine]:
    engine = BatchEngine(model, tokenizer, limits, grammars=grammars)
    outputs: list[EngineOutput] = engine.step(requests, [])
    for _ in range(2000):
        if not engine.active:
            break
        outputs.extend(engine.step([], []))
    outcomes: dict[str, Outcome] = {}
    for output in outputs:
        outcome = outcomes.setdefault(f"{output.request_id}/{getattr(output.event, 'choice', 0)}", Outcome())
        event = output.event
        if isinstance(event, TokensGenerated):
            outcome.text += event.text
            outcome.token_ids += event.token_ids
            outcome.logprobs += tuple(entry.logprob for entry in event.logprobs)
        elif isinstance(event, GenerationFinished):
            outcome.finish = (event.reason, event.completion_tokens, event.prompt_tokens)
        elif isinstance(event, SnapshotTaken):
            outcome.snapshots += (event.tokens,)
    return outcomes, engine


def assert_same(plain: dict[str, Outcome], speculative: dict[str, Outcome]) -> None:
    assert set(plain) == set(speculative)
    for name, expected in plain.items():
        got = speculative[name]
        assert got.text == expected.text, name
        assert got.token_ids == expected.token_ids, name
        assert got.finish == expected.finish, name
        assert got.snapshots == expected.snapshots, name
        assert got.logprobs == pytest.approx(expected.logprobs, abs=LOGPROB_ABS), name


def request(name: str, prompt: tuple[int, ...], max_tokens: int = 40, **sampling: Any) -> EngineRequest:
    fields = {"temperature": 0.0, **sampling}
    return EngineRequest(
        request_id=RequestId(name), prompt_tokens=prompt, sampling=SamplingParams(max_tokens=max_tokens, **fields)
    )


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return tiny_models.load_float32(tiny_llama_dir)


@pytest.fixture(scope="module")
def smollm2(cache_dir: Path) -> tuple[Any, Any]:
    """As the server serves it on a CPU: weights dequantized to float32."""
    loaded = load_model(
        resolve_model_source(None),
        served_model_name=None,
        cache_dir=cache_dir,
        weight_format="auto",
        first_pass=False,
        progress=Progress(enabled=False),
    )
    return loaded.model, loaded.tokenizer


@pytest.fixture(scope="module")
def tiny_grammars(tiny: tuple[Any, Any]) -> GrammarCompiler:
    """The tiny llama's grammar compiler, built once (its 49,152-token vocabulary takes a while to index)."""
    tokenizer = tiny[1]
    return GrammarCompiler(build_tokenizer(tokenizer._tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids))


def loop_prompt(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text))


TINY_TEXTS = {
    "repeat": "one two three four one two three four one two three four one two",
    "counting": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21",
    "prose": "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "code": "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n\ndef h(x):\n",
}


def tiny_table(tokenizer: Any) -> list[EngineRequest]:
    prompts = {name: loop_prompt(tokenizer, text) for name, text in TINY_TEXTS.items()}
    return [
        request("repeat", prompts["repeat"]),
        request("counting-logprobs", prompts["counting"], logprobs=True, top_logprobs=2),
        request("prose-stop", prompts["prose"], stop=(" the",)),
        request("code-short", prompts["code"], max_tokens=7),
        request("repeat-seeded", prompts["repeat"], temperature=0.8, seed=11, top_k=4),
        request("code-seeded-top-p", prompts["code"], temperature=1.0, seed=5, top_p=0.6),
    ]


def test_a_single_stream_gives_what_it_gives_without_drafts(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    for one in tiny_table(tokenizer):
        plain, _ = run(model, tokenizer, PLAIN, [one])
        speculative, _ = run(model, tokenizer, SPECULATIVE, [one])
        assert_same(plain, speculative)


@bitwise_across_shapes
def test_a_mixed_batch_gives_what_it_gives_without_drafts_and_drafts_land(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    requests = tiny_table(tokenizer)
    plain, _ = run(model, tokenizer, PLAIN, requests)
    speculative, engine = run(model, tokenizer, SPECULATIVE, requests)
    assert_same(plain, speculative)
    counters = engine.speculation
    assert counters.verify_steps > 0 and 0 < counters.accepted < counters.drafted  # some land, some miss
    assert counters.steps < sum(outcome.finish[1] for outcome in plain.values())


@bitwise_across_shapes
def test_samples_of_one_prompt_and_requests_sharing_a_prefix_are_unchanged(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    shared = loop_prompt(tokenizer, TINY_TEXTS["repeat"] + " " + TINY_TEXTS["code"])
    requests = [
        replace(request("samples", shared, temperature=0.7, seed=3), n=3),
        request("a", (*shared, *loop_prompt(tokenizer, " one two three"))),
        request("b", (*shared, *loop_prompt(tokenizer, " def k(y):"))),
    ]
    plain, _ = run(model, tokenizer, PLAIN, requests)
    speculative, _ = run(model, tokenizer, SPECULATIVE, requests)
    assert_same(plain, speculative)


def test_penalised_and_speculating_sequences_share_a_batch(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = loop_prompt(tokenizer, TINY_TEXTS["repeat"])
    requests = [
        request("penalised", prompt, frequency_penalty=0.5, logit_bias=((tokenizer.encode(" two")[0], 2.0),)),
        request("free", prompt),
    ]
    plain, _ = run(model, tokenizer, PLAIN, requests)
    speculative, engine = run(model, tokenizer, SPECULATIVE, requests)
    assert_same(plain, speculative)
    assert engine.speculation.accepted > 0


CARD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"enum": ["London", "Paris"]},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2000},
        "tags": {"type": "array", "items": {"enum": ["math", "poetry"]}, "maxItems": 2},
    },
    "required": ["name", "city", "born", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("per_position", [0.001, 0.02, 50.0], ids=["cheap-columns", "some-cut", "none-pay"])
def test_constrained_sequences_append_forced_tokens_and_write_what_they_would_have(
    tiny: tuple[Any, Any], tiny_grammars: GrammarCompiler, per_position: float
) -> None:
    """Forced runs and drafts cut by the block width (forced tokens past it given back to the grammar) or not
    verified at all: the same output."""
    model, tokenizer = tiny
    grammars = tiny_grammars
    constraint = json_schema(CARD_SCHEMA, name="card", param="response_format")
    prompt = loop_prompt(tokenizer, "Ada Lovelace, London, 1815: ")
    requests = [
        request("greedy", prompt, max_tokens=60, constraint=constraint, logprobs=True),
        request("seeded", prompt, max_tokens=60, constraint=constraint, temperature=0.9, seed=4),
        request("cut", prompt, max_tokens=5, constraint=constraint),  # max_tokens inside a forced run
        request("free", loop_prompt(tokenizer, TINY_TEXTS["repeat"])),
    ]
    plain, _ = run(model, tokenizer, PLAIN, requests, grammars)
    limits = replace(SPECULATIVE, step_costs=lambda: FixedCosts(1.0, per_position))
    speculative, engine = run(model, tokenizer, limits, requests, grammars)
    assert_same(plain, speculative)
    assert speculative["cut/0"].finish[:2] == (FinishReason.LENGTH, 5)
    counters = engine.speculation
    if per_position < 0.01:
        assert counters.forced > 0 and counters.accepted > 0
    if per_position > 1:
        assert counters.forced == counters.verify_steps == 0


def test_a_snapshotting_request_stores_the_same_completion(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    prompt = loop_prompt(tokenizer, TINY_TEXTS["repeat"])
    requests = [replace(request("kept", prompt, max_tokens=25), snapshots=True, boundary=len(prompt) - 3)]
    plain, _ = run(model, tokenizer, PLAIN, requests)
    speculative, engine = run(model, tokenizer, SPECULATIVE, requests)
    assert_same(plain, speculative)
    assert plain["kept/0"].snapshots and engine.speculation.accepted > 0


def test_unseeded_sampling_keeps_its_distribution(tiny: tuple[Any, Any]) -> None:
    """Tokens 4-6 of many unseeded samples (by then they loop, so drafts are tried and most land), with and without
    drafts: one distribution (chi-square)."""
    model, tokenizer = tiny
    prompt = loop_prompt(tokenizer, TINY_TEXTS["repeat"])

    def tallies(speculate: bool) -> tuple[Counter[tuple[int, ...]], BatchEngine]:
        counted: Counter[tuple[int, ...]] = Counter()
        engine: BatchEngine | None = None
        for round_ in range(6):
            mx.random.seed(1000 * speculate + round_)
            batch = [request(f"s{i}", prompt, max_tokens=6, temperature=1.0, top_k=2) for i in range(32)]
            outcomes, engine = run(
                model,
                tokenizer,
                replace(SPECULATIVE if speculate else PLAIN, max_batch=32, prefill_batch=32),
                batch,
            )
            counted.update(outcome.token_ids[3:6] for outcome in outcomes.values())
        assert engine is not None
        return counted, engine

    plain, _ = tallies(False)
    speculative, engine = tallies(True)
    assert engine.speculation.accepted > 0 and engine.speculation.accepted < engine.speculation.drafted
    common = [key for key in plain if plain[key] >= 5 and speculative[key] >= 5]
    assert len(common) >= 3
    table = [
        [tally[k] for k in common] + [sum(tally.values()) - sum(tally[k] for k in common)]
        for tally in (plain, speculative)
    ]
    assert chi_square(table) < chi_square_critical(len(common), z=3.09)  # p = 0.001


def chi_square(table: list[list[int]]) -> float:
    """Pearson's statistic of a contingency table (two rows: the same categories counted twice)."""
    total = sum(map(sum, table))
    columns = [sum(column) for column in zip(*table, strict=True)]
    return sum(
        float((count - sum(row) * columns[j] / total) ** 2 / (sum(row) * columns[j] / total))
        for row in table
        for j, count in enumerate(row)
    )


def chi_square_critical(degrees: int, z: float) -> float:
    """The chi-square quantile for a normal quantile `z` (Wilson-Hilferty: within 3% of the exact value here)."""
    return float(degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3)


SOURCE = """def parse_line(line):
    name, _, value = line.partition("=")
    return name.strip(), value.strip()


def load(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            if line.strip() and not line.startswith("#"):
                name, value = parse_line(line)
                settings[name] = value
    return settings
"""


@pytest.mark.real_model
def test_smollm2_copying_code_is_token_identical_and_takes_fewer_steps(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": f"Return this code unchanged:\n```python\n{SOURCE}```"}]
    prompt = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    requests = [request("copy", prompt, max_tokens=48, logprobs=True, stop=("settings = {}",))]
    plain, _ = run(model, tokenizer, PLAIN, requests)
    speculative, engine = run(model, tokenizer, SPECULATIVE, requests)
    assert_same(plain, speculative)
    assert "def parse_line" in plain["copy/0"].text
    assert engine.speculation.steps < 0.75 * plain["copy/0"].finish[1]


ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "address": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["customer", "address", "items"],
    "additionalProperties": False,
}
ORDER = (
    "Order 1187 from Margaret Hamilton, 1 Memorial Drive, Cambridge, Massachusetts 02142: a mechanical keyboard "
    "with brown switches, a 27-inch monitor stand, two USB-C charging cables.\n"
    "Return the customer, the address and the items as JSON."
)


@pytest.mark.real_model
def test_smollm2_json_echoing_its_input_drafts_values_and_forces_keys(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    grammars = GrammarCompiler(build_tokenizer(tokenizer._tokenizer, VOCAB_SIZE, tokenizer.eos_token_ids))
    prompt = tuple(tokenizer.apply_chat_template([{"role": "user", "content": ORDER}], add_generation_prompt=True))
    constraint = json_schema(ORDER_SCHEMA, name="order", param="response_format")
    # 40 tokens: the address is copied by token 24, then the "items" key is forced and the items copy it again
    # (measured: 8 forced, 17 drafted tokens kept, 15 steps). Each token decoded costs ~85 ms on a CPU.
    requests = [request("order", prompt, max_tokens=40, constraint=constraint, logprobs=True)]
    plain, _ = run(model, tokenizer, PLAIN, requests, grammars)
    speculative, engine = run(model, tokenizer, SPECULATIVE, requests, grammars)
    assert_same(plain, speculative)
    assert "1 Memorial Drive, Cambridge" in plain["order/0"].text  # a value copied from the input
    counters = engine.speculation
    assert counters.forced > 0 and counters.accepted > 0
    assert counters.steps < 0.8 * plain["order/0"].finish[1]


@pytest.mark.parametrize("limits", [PLAIN, SPECULATIVE], ids=["plain", "speculative"])
def test_a_seeded_request_replayed_after_a_fault_writes_what_it_would_have(
    tiny: tuple[Any, Any], limits: BatchLimits
) -> None:
    """The step that failed had drawn tokens nobody received; the replay draws them again with the same keys."""
    model, tokenizer = tiny
    prompt = loop_prompt(tokenizer, TINY_TEXTS["repeat"])
    requests = [
        request("seeded", prompt, max_tokens=30, temperature=0.9, seed=11),
        request("greedy", prompt, max_tokens=30),
    ]
    undisturbed, _ = run(model, tokenizer, limits, requests)
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, limits)
    outputs = engine.step(requests, [])
    for _ in range(3):
        outputs += engine.step([], [])
    flaky.failures = 1  # the next forward pass fails: both sequences are replayed alone
    while engine.active:
        outputs += engine.step([], [])
    texts = {
        name: "".join(o.event.text for o in outputs if o.request_id == name and isinstance(o.event, TokensGenerated))
        for name in ("seeded", "greedy")
    }
    assert texts == {name: undisturbed[f"{name}/0"].text for name in ("seeded", "greedy")}
    assert undisturbed["seeded/0"].text != undisturbed["greedy/0"].text
