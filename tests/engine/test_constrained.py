"""Constrained decoding in the batch engine (tiny random-weight llama, SmolLM2 vocabulary): grammar masks per
sequence, filled once per step, beside free sequences that run as they would alone; and the grammar state of one
sequence driven by hand (a tool call triggered by its start marker)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import jsonschema
import mlx.core as mx
import pytest

from courier.core.prompt_cache.entries import Origin
from courier.engine.batch_engine import BatchEngine
from courier.engine.constrained import ConstrainedSequence, MaskFiller
from courier.engine.engine_io import BatchLimits, EngineOutput, EngineRequest, SnapshotTaken
from courier.engine.generation import (
    FinishReason,
    GenerationFailed,
    GenerationFinished,
    RequestId,
    SamplingParams,
    TokensGenerated,
)
from courier.engine.sampling import SeededSampler
from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import Constraint, json_schema, tool_calls
from tests.support import tiny_models
from tests.support.faulty_model import FailingModel
from tests.support.grammar import FORM, VOCAB_SIZE, WEATHER

EOS = 2
LIMITS = BatchLimits(max_batch=16, prefill_batch=16, prefill_step_size=64)
# Bounded schemas: whatever random weights pick, an output ends within a few dozen tokens.
SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "integer": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 250}},
        "required": ["n"],
        "additionalProperties": False,
    },
    "string": {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 4}, "flag": {"type": "boolean"}},
        "required": ["s", "flag"],
        "additionalProperties": False,
    },
    "list": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
}
# At least twenty items: no output of it ends within the first steps.
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 20}


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> tuple[Any, Any]:
    return tiny_models.load_float32(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(loaded: tuple[Any, Any]) -> GrammarCompiler:
    return GrammarCompiler(build_tokenizer(loaded[1]._tokenizer, VOCAB_SIZE, loaded[1].eos_token_ids))


def engine_for(loaded: tuple[Any, Any], compiler: GrammarCompiler | None, limits: BatchLimits = LIMITS) -> BatchEngine:
    model, tokenizer = loaded
    return BatchEngine(model, tokenizer, limits, grammars=compiler)


def schema_constraint(name: str, schema: dict[str, Any] | None = None) -> Constraint:
    return json_schema(schema if schema is not None else SCHEMAS[name], name=name, param="response_format")


def request(
    name: str,
    constraint: Constraint | None,
    *,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int | None = None,
    prompt: tuple[int, ...] = (1, 2, 3, 4),
) -> EngineRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, constraint=constraint)
    return EngineRequest(request_id=RequestId(name), prompt_tokens=prompt, sampling=sampling)


def run_until_done(engine: BatchEngine, outputs: list[EngineOutput], steps: int = 500) -> list[EngineOutput]:
    for _ in range(steps):
        if not engine.active:
            break
        outputs.extend(engine.step([], []))
    assert not engine.active
    return outputs


def run(engine: BatchEngine, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
    return run_until_done(engine, engine.step(list(requests), []))


def ends(outputs: list[EngineOutput]) -> dict[str, GenerationFinished | GenerationFailed]:
    return {o.request_id: o.event for o in outputs if isinstance(o.event, GenerationFinished | GenerationFailed)}


def texts(outputs: list[EngineOutput]) -> dict[str, str]:
    collected: dict[str, str] = {}
    for output in outputs:
        if isinstance(output.event, TokensGenerated):
            collected[output.request_id] = collected.get(output.request_id, "") + output.event.text
    return collected


def test_constrained_sequences_validate_beside_a_free_one_that_runs_as_it_would_alone(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    free_prompt = tuple(loaded[1].encode("Tell me about lighthouses."))
    free = request("free", None, max_tokens=24, temperature=0, prompt=free_prompt)
    constrained = [
        request(f"{name}-{seed}", schema_constraint(name), seed=seed) for name in SCHEMAS for seed in range(3)
    ]
    outputs = run(engine_for(loaded, compiler), [*constrained, free])
    finished, written = ends(outputs), texts(outputs)
    assert set(finished) == {r.request_id for r in [*constrained, free]}
    stopped: dict[str, int] = dict.fromkeys(SCHEMAS, 0)
    for name, schema in SCHEMAS.items():
        for seed in range(3):
            event = finished[f"{name}-{seed}"]
            assert isinstance(event, GenerationFinished)
            if event.reason is FinishReason.STOP:
                jsonschema.validate(json.loads(written[f"{name}-{seed}"]), schema)
                stopped[name] += 1
    assert all(count > 0 for count in stopped.values()), stopped
    alone = run(engine_for(loaded, None), [free])
    assert written["free"] == texts(alone)["free"]
    assert finished["free"] == ends(alone)["free"]


def test_every_due_mask_is_filled_in_one_call_per_step(loaded: tuple[Any, Any], compiler: GrammarCompiler) -> None:
    engine = engine_for(loaded, compiler)
    masks = engine.masks
    assert masks is not None
    long = schema_constraint("long", LONG)
    requests = [request(f"c{n}", long, seed=n) for n in range(3)]
    engine.step([*requests, request("free", None, temperature=0)], [])
    engine.step([], [])  # every sequence decoding
    for _ in range(8):
        fills = len(masks.fill_rows)
        timed = len(masks.fill_seconds)
        outputs = engine.step([], [])
        assert not ends(outputs)
        assert len(masks.fill_rows) == fills + 1 and masks.fill_rows[-1] == 3
        assert len(masks.fill_seconds) == timed + 1
    engine.step([], [RequestId("c0")])
    fills = len(masks.fill_rows)
    engine.step([], [])
    assert list(masks.fill_rows)[fills:] == [2]


def test_a_seeded_constrained_request_repeats_alone_and_in_a_batch(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    constraint = schema_constraint("string")

    def sample(seed: int, neighbours: int = 0) -> str:
        others = [request(f"other{n}", schema_constraint("enum"), seed=100 + n) for n in range(neighbours)]
        return texts(run(engine_for(loaded, compiler), [request("seeded", constraint, seed=seed), *others]))["seeded"]

    first = sample(7)
    assert sample(7) == first
    assert sample(7, neighbours=3) == first
    assert len({sample(seed) for seed in range(4)}) > 1  # the seed matters: sampling really is random


def test_a_replayed_constrained_sequence_keeps_its_grammar_state(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    model, tokenizer = loaded
    bounded = {**LONG, "maxItems": 24}  # ends within 80 tokens, but not within the first steps
    constrained = request("json", schema_constraint("bounded", bounded), temperature=0, max_tokens=80)
    undisturbed = run(engine_for(loaded, compiler), [constrained])
    flaky = FailingModel(model)
    engine = BatchEngine(flaky, tokenizer, LIMITS, grammars=compiler)
    outputs = engine.step([constrained, request("free", None, temperature=0, prompt=(9, 8, 7))], [])
    for _ in range(6):
        outputs += engine.step([], [])
    flaky.failures = 1
    outputs += engine.step([], [])  # fails; both are replayed alone and rejoin the batch
    assert engine.active == 2
    run_until_done(engine, outputs)
    event = ends(outputs)["json"]
    assert isinstance(event, GenerationFinished) and event.reason is FinishReason.STOP
    jsonschema.validate(json.loads(texts(outputs)["json"]), bounded)
    assert texts(outputs)["json"] == texts(undisturbed)["json"]


def test_a_fault_that_loses_the_step_closing_a_constrained_output_still_ends_it_valid(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    """A fault can surface after the logits processors ran (an error at evaluation), losing a step whose tokens
    the grammar already read; the replay must take them back, even the one that completed the output.

    The fault is a second sequence's: its triggered grammar does not compile, so the step raises when its trigger
    appears, after the processor of the first sequence (admitted first, so first in the batch) read its closing
    token.
    """
    tokenizer = loaded[1]
    constrained = request("json", schema_constraint("integer"), temperature=0)
    alone = run(engine_for(loaded, compiler), [constrained])
    reference = ends(alone)["json"]
    assert isinstance(reference, GenerationFinished) and reference.reason is FinishReason.STOP
    closing = reference.completion_tokens - 2  # the index of its last token before the end of sequence
    # The free text of the faulting sequence, token by token (its completion snapshot holds the exact tokens).
    free = replace(request("free", None, seed=5, prompt=(9, 8, 7)), snapshots=True)
    snapshots = [o.event for o in run(engine_for(loaded, compiler), [free]) if isinstance(o.event, SnapshotTaken)]
    snapshot = next(taken for taken in snapshots if taken.origin is Origin.COMPLETION)
    pieces = [str(tokenizer.decode([token])) for token in snapshot.tokens[3:]]
    trigger = pieces[closing - 1] + pieces[closing]
    assert all(trigger not in "".join(pieces[: index + 1]) for index in range(closing))  # appears then, not before
    broken = Constraint(grammar="not a grammar", key="broken", label="broken", trigger=trigger)
    faulting = replace(free, sampling=replace(free.sampling, constraint=broken), snapshots=False)
    outputs = run(engine_for(loaded, compiler), [constrained, faulting])
    assert texts(outputs)["json"] == texts(alone)["json"]
    jsonschema.validate(json.loads(texts(outputs)["json"]), SCHEMAS["integer"])


def take(masks: MaskFiller, count: int) -> list[int]:
    """The rows `count` new constrained sequences would get (given straight back)."""
    rows = [masks.acquire() for _ in range(count)]
    for row in rows:
        masks.release(row)
    return rows


def test_a_constrained_sequence_gives_its_mask_row_back_however_it_ends(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    """A filler has a row per batch slot; a row not given back makes the next acquisition grow it past them."""
    limits = BatchLimits(max_batch=4, prefill_batch=4, prefill_step_size=64)
    engine = engine_for(loaded, compiler, limits)
    masks = engine.masks
    assert masks is not None
    long = schema_constraint("long", LONG)
    outputs = engine.step([request(f"c{n}", long, seed=n) for n in range(4)], [])
    outputs += engine.step([], [])
    outputs += engine.step([], [RequestId("c0"), RequestId("c1")])  # cancelled
    assert engine.active == 2
    assert all(row < 4 for row in take(masks, 2))
    outputs += engine.step([request("empty", long, prompt=())], [])  # fails to start
    assert isinstance(ends(outputs)["empty"], GenerationFailed)
    assert all(row < 4 for row in take(masks, 2))
    run_until_done(engine, outputs)  # the others finish
    assert set(ends(outputs)) == {"c2", "c3", "empty"}
    assert sorted(take(masks, 4)) == [0, 1, 2, 3]


# ---------------------------------------------------------------- one sequence's grammar state, driven by hand

CALL = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PROMPT = (1, 2, 3)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class Driver:
    """Feeds a `ConstrainedSequence` tokens as the batch generator does: the context so far to the processor, then
    logits that favour one token to the sampler."""

    def __init__(self, sequence: ConstrainedSequence, favoured: int) -> None:
        self.sequence = sequence
        self.context = list(PROMPT)
        self.favoured = favoured

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Each token in turn, and what the sampler picks after it."""
        return [self.next(token) for token in tokens]

    def next(self, token: int | None = None) -> int:
        if token is not None:
            self.context.append(token)
        logits = mx.zeros((1, VOCAB_SIZE))
        logits[0, self.favoured] = 10.0
        logits = self.sequence.process(mx.array(self.context, dtype=mx.int32), logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return cast("int", self.sequence.sample(logprobs).item())


@pytest.fixture(scope="module")
def tokenize(compiler: GrammarCompiler) -> Callable[[str], list[int]]:
    return compiler.tokenizer.tokenize_str


def driver(
    loaded: tuple[Any, Any],
    compiler: GrammarCompiler,
    constraint: Constraint,
    favoured: int,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> tuple[Driver, MaskFiller]:
    filler = MaskFiller(VOCAB_SIZE, 2)
    sequence = ConstrainedSequence(
        constraint,
        compiler=compiler,
        filler=filler,
        decode=decode or loaded[1].decode,
        prompt_length=len(PROMPT),
        sampler=greedy,
        eos_tokens=[EOS],
    )
    return Driver(sequence, favoured), filler


def test_a_triggered_call_is_constrained_from_its_marker_and_free_text_follows(
    loaded: tuple[Any, Any], compiler: GrammarCompiler, tokenize: Callable[[str], list[int]]
) -> None:
    hello = tokenize(" Hello")[0]
    constraint = tool_calls([WEATHER], FORM, forced=False, parallel=True, param="tools")
    drive, filler = driver(loaded, compiler, constraint, hello)
    # Free text, the marker's first pieces included: the sampler's own pick, and no mask is ever filled.
    assert drive.next() == hello
    assert set(drive.feed(tokenize("Let me check. <tool_call"))) == {hello}
    assert len(filler.fill_rows) == 0
    # The marker is complete: the call's grammar holds until the end marker.
    picks = drive.feed(tokenize(">"))
    assert picks != [hello] and loaded[1].decode(picks).startswith("\n")
    body = tokenize(CALL)
    picks = drive.feed(body)
    assert hello not in picks[:-1]
    assert len(filler.fill_rows) == len(body)  # one fill per constrained step, one row each
    # Repeatable: after the call, text is free again, and a second marker starts a second call.
    assert picks[-1] == hello
    assert drive.feed(tokenize(" And <tool_call")) == [hello] * len(tokenize(" And <tool_call"))
    assert drive.feed(tokenize(">")) != [hello]


def test_a_single_triggered_call_ends_the_output(
    loaded: tuple[Any, Any], compiler: GrammarCompiler, tokenize: Callable[[str], list[int]]
) -> None:
    hello = tokenize(" Hello")[0]
    constraint = tool_calls([WEATHER], FORM, forced=False, parallel=False, param="tools")
    drive, _ = driver(loaded, compiler, constraint, hello)
    drive.feed(tokenize("<tool_call>"))
    assert drive.feed(tokenize(CALL))[-1] == EOS  # favoured or not, only the end of sequence may follow
    assert drive.next() == EOS


def test_a_token_the_grammar_refuses_ends_the_output(
    loaded: tuple[Any, Any], compiler: GrammarCompiler, tokenize: Callable[[str], list[int]]
) -> None:
    hello = tokenize(" Hello")[0]
    drive, _ = driver(loaded, compiler, schema_constraint("enum"), hello)
    first = drive.next()
    assert first != hello and loaded[1].decode([first]).startswith("{")
    assert drive.next(hello) == EOS  # what no mask allowed (a replay gone wrong): end, never loop
    assert drive.sequence.failure.startswith(f"token {hello} refused")  # and the reply is reported cut


# After four items, an object of 2,000 properties: a row past llguidance's limit, met only while parsing.
FAILS_MID_REPLY = {
    "type": "object",
    "properties": {
        "a": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 4, "maxItems": 4},
        "b": {"type": "object", "properties": {f"p{index}": {} for index in range(2000)}},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_a_grammar_that_cannot_go_on_ends_the_output_marked_failed(
    loaded: tuple[Any, Any], compiler: GrammarCompiler, tokenize: Callable[[str], list[int]]
) -> None:
    hello = tokenize(" Hello")[0]
    drive, _ = driver(loaded, compiler, schema_constraint("deep", FAILS_MID_REPLY), hello)
    assert EOS not in drive.feed(tokenize('{"a": [1, 2, 1, 2')) and not drive.sequence.failure
    # The token closing the array makes llguidance predict the 2,000 properties: refused although the mask allowed it.
    assert set(drive.feed(tokenize('], "b": {'))) == {EOS} and "max is 2000" in drive.sequence.failure


def test_an_engine_reply_whose_grammar_fails_finishes_as_a_length_cut(
    loaded: tuple[Any, Any], compiler: GrammarCompiler
) -> None:
    deep = schema_constraint("deep", FAILS_MID_REPLY)
    outputs = run(engine_for(loaded, compiler), [request(f"deep{seed}", deep, seed=seed) for seed in range(2)])
    for seed in range(2):
        finished = ends(outputs)[f"deep{seed}"]
        assert isinstance(finished, GenerationFinished) and finished.reason is FinishReason.LENGTH
        assert finished.completion_tokens < 64 and texts(outputs)[f"deep{seed}"].startswith('{"a": [')


def test_a_marker_completed_inside_a_token_still_triggers_the_call(
    loaded: tuple[Any, Any], compiler: GrammarCompiler, tokenize: Callable[[str], list[int]]
) -> None:
    """A vocabulary may hold a token that closes the marker and goes on (">\\n" in many BPE vocabularies).

    SmolLM2's has none, so this decode spells one: the token for ">" reads as ">\\n". The call must still be
    constrained after it, its separator already written.
    """
    hello, close = tokenize(" Hello")[0], tokenize(">")[0]
    real = loaded[1].decode

    def decode(tokens: Sequence[int]) -> str:
        return ">\n" if list(tokens) == [close] else str(real(tokens))

    constraint = tool_calls([WEATHER], FORM, forced=False, parallel=True, param="tools")
    drive, _ = driver(loaded, compiler, constraint, hello, decode)
    drive.feed(tokenize("<tool_call"))
    pick = drive.next(close)
    assert pick != hello
    assert str(real([pick])).startswith("{")  # the separator is behind: the call's JSON opens


def seeded_sequence(loaded: tuple[Any, Any], compiler: GrammarCompiler, constraint: Constraint) -> ConstrainedSequence:
    return ConstrainedSequence(
        constraint,
        compiler=compiler,
        filler=MaskFiller(VOCAB_SIZE, 1),
        decode=loaded[1].decode,
        prompt_length=len(PROMPT),
        sampler=SeededSampler(7, temperature=1.0),
        eos_tokens=[EOS],
    )


# After its first token, the rest of it is one forced run that completes the grammar.
CONSTANT = {"type": "object", "properties": {"a": {"const": "the end of it"}}, "required": ["a"]}


@pytest.mark.parametrize("kept", [0, 1])
@pytest.mark.parametrize(
    ("constraint", "json_text"),
    [
        (schema_constraint("enum"), '{"color": "red", "ok": true}'),
        (schema_constraint("constant", {**CONSTANT, "additionalProperties": False}), '{"a": "the end of it"}'),
    ],
    ids=["keys", "to-the-end"],
)
def test_forced_tokens_given_back_leave_the_grammar_and_the_seed_as_fewer_forced_would(
    loaded: tuple[Any, Any],
    compiler: GrammarCompiler,
    tokenize: Callable[[str], list[int]],
    kept: int,
    constraint: Constraint,
    json_text: str,
) -> None:
    """A forced run cut by the block width: the grammar and a seeded sampler's key stand where a run of only the
    kept tokens would have left them, the run that completes the grammar included."""
    text = tokenize(json_text)
    runs = 0
    for end in range(len(text)):
        probe = seeded_sequence(loaded, compiler, constraint)
        for token in text[:end]:
            probe.forced_after(token, 0)
        forced = probe.forced_after(text[end], 16)
        if len(forced) < 2:
            continue
        runs += 1
        cut, fewer = probe, seeded_sequence(loaded, compiler, constraint)
        cut.take_back(len(forced) - kept)
        for token in text[:end]:
            fewer.forced_after(token, 0)
        assert fewer.forced_after(text[end], kept) == forced[:kept]
        following = forced[kept:] + text[end + 1 + len(forced) :]
        assert cut.valid(following) == fewer.valid(following) == len(following)
        assert cut.forced_after(following[0], 16) == fewer.forced_after(following[0], 16)
        assert cut.seeded is not None and fewer.seeded is not None
        assert cut.seeded.position == fewer.seeded.position
    assert runs >= 1
