"""Structured outputs (constrained decoding) on the embedded SmolLM2: validity beside mlx_lm.server, the cost of a
grammar against free text, and the grammar's own work in process."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import openai

from bench.harness import cli, models, servers
from bench.harness.clients import Round, async_client, burst, json_schema_format, pooled_tps, stream_chat, user
from bench.harness.report import environment, head, inline, percent, progress, shown, table, write_json
from bench.harness.servers import COURIER, MLX_LM_F32, BenchmarkError, Launcher, Server, ServerRecord, ServerSpec
from bench.harness.stats import percentile
from bench.throughput import TOPICS
from courier.platform.blas import load_optimized_blas

PARTS = ("validity", "throughput", "micro")
TARGET_VALID_AMONG_FINISHED = 1.0
TARGET_THROUGHPUT_RATIO = 0.90
FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
VALIDITY_TEMPERATURE = 1.0
THROUGHPUT_TEMPERATURE = 0.0
LOG_PROBLEM = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback")
LOG_PROBLEMS_SHOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaCase:
    """A schema, the task that asks for it, and one instance valid against it (properties in the schema's order,
    as the grammar writes them)."""

    name: str
    task: str
    schema: dict[str, Any]
    instance: Any


def _object(properties: dict[str, Any], required: Sequence[str] | None = None) -> dict[str, Any]:
    """A closed object: `required` (all its properties unless given) and no others."""
    needed = list(properties) if required is None else list(required)
    return {"type": "object", "properties": properties, "required": needed, "additionalProperties": False}


def _string(max_length: int, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length} | ({"minLength": min_length} if min_length else {})


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _array(items: dict[str, Any], max_items: int, min_items: int | None = None) -> dict[str, Any]:
    bounds = {"minItems": min_items} if min_items is not None else {}
    return {"type": "array", **bounds, "maxItems": max_items, "items": items}


def _pattern(pattern: str) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


BOOLEAN = {"type": "boolean"}
POINT_REF = {"$ref": "#/$defs/point"}
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        name="person",
        task="Invent a person: their name, age and email address.",
        schema=_object(
            {
                "name": _string(40, 1),
                "age": _integer(0, 120),
                "email": _pattern(r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)$"),
            }
        ),
        instance={"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    SchemaCase(
        name="shipping",
        task="Write the shipping label for a parcel sent to a friend in Europe.",
        schema=_object(
            {
                "recipient": _string(40, 1),
                "address": _object(
                    {
                        "street": _string(50, 1),
                        "city": _string(30, 1),
                        "postcode": _pattern(r"^[0-9]{5}$"),
                        "country": _enum("FR", "DE", "ES", "IT", "NL", "PT"),
                    }
                ),
                "express": BOOLEAN,
            }
        ),
        instance={
            "recipient": "Marie Curie",
            "address": {"street": "12 Rue de la Paix", "city": "Paris", "postcode": "75002", "country": "FR"},
            "express": True,
        },
    ),
    SchemaCase(
        name="shopping_list",
        task="Make a shopping list for a pancake breakfast.",
        schema=_object({"items": _array(_object({"item": _string(30, 1), "quantity": _integer(1, 20)}), 5, 1)}),
        instance={"items": [{"item": "flour", "quantity": 1}, {"item": "eggs", "quantity": 6}]},
    ),
    SchemaCase(
        name="sentiment",
        task="Classify the sentiment of this review: 'The soup was cold but the staff were lovely.'",
        schema=_object(
            {
                "sentiment": _enum("positive", "negative", "neutral", "mixed"),
                "confidence_percent": _integer(0, 100),
                "language": {"enum": ["en", "fr", "de", "es"]},
            }
        ),
        instance={"sentiment": "mixed", "confidence_percent": 80, "language": "en"},
    ),
    SchemaCase(
        name="shape",
        task="Describe one geometric shape to draw, and its colour.",
        schema=_object(
            {
                "shape": {
                    "anyOf": [
                        _object({"kind": {"const": "circle"}, "radius": _integer(1, 100)}),
                        _object(
                            {"kind": {"const": "rectangle"}, "width": _integer(1, 100), "height": _integer(1, 100)}
                        ),
                    ]
                },
                "color": _enum("red", "green", "blue", "black"),
            }
        ),
        instance={"shape": {"kind": "rectangle", "width": 40, "height": 25}, "color": "blue"},
    ),
    SchemaCase(
        name="route",
        task="Plan a short route on a grid: where it starts, where it ends, and up to three points on the way.",
        schema={
            "$defs": {"point": _object({"x": _integer(-100, 100), "y": _integer(-100, 100)})},
            **_object({"start": POINT_REF, "end": POINT_REF, "waypoints": _array(POINT_REF, 3)}),
        },
        instance={"start": {"x": 0, "y": 0}, "end": {"x": 10, "y": -4}, "waypoints": [{"x": 5, "y": 2}]},
    ),
    SchemaCase(
        name="article",
        task="Give the title of a blog post about learning to cook, a few tags for it, and whether it is published.",
        schema=_object(
            {"title": _string(60, 3), "tags": _array(_pattern(r"^[a-z]{2,12}$"), 4, 1), "published": BOOLEAN}
        ),
        instance={"title": "Cooking for beginners", "tags": ["cooking", "food"], "published": False},
    ),
    SchemaCase(
        name="event",
        task="Schedule a team meeting next year: what it is, its date, its start time and how many attend.",
        schema=_object(
            {
                "event": _string(40, 1),
                "date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"),
                "time": _pattern(r"^([01][0-9]|2[0-3]):[0-5][0-9]$"),
                "attendees": _integer(1, 500),
            }
        ),
        instance={"event": "Quarterly planning", "date": "2027-03-14", "time": "09:30", "attendees": 12},
    ),
    SchemaCase(
        name="recipe",
        task="Write a simple recipe: its name, servings, ingredients in grams, and whether it is vegetarian.",
        schema=_object(
            {
                "name": _string(30, 1),
                "servings": _integer(1, 12),
                "ingredients": _array(_object({"name": _string(20, 1), "grams": _integer(1, 1000)}), 4, 2),
                "vegetarian": BOOLEAN,
            }
        ),
        instance={
            "name": "Tomato soup",
            "servings": 4,
            "ingredients": [{"name": "tomatoes", "grams": 800}, {"name": "onion", "grams": 150}],
            "vegetarian": True,
        },
    ),
    SchemaCase(
        name="ticket",
        task="File a support ticket about a printer that does not print.",
        schema=_object(
            {
                "id": _integer(1, 99999),
                "status": {"enum": ["open", "in_progress", "closed"]},
                "assignee": {"anyOf": [_string(20, 1), {"type": "null"}]},
                "priority": _integer(1, 5),
                "note": _string(60),
            },
            required=["id", "status", "assignee"],
        ),
        instance={"id": 4512, "status": "open", "assignee": None, "priority": 2},
    ),
)


def essay_schema(max_tokens: int) -> dict[str, Any]:
    """The throughput arm's schema: its shortest valid output is longer than `max_tokens` (a section is at least 8
    tokens), so a constrained reply runs to the cap; bounded strings keep the grammar's structure exercised."""
    section = _object({"heading": _string(60), "text": _string(300)})
    return _object(
        {"title": _string(80), "sections": {"type": "array", "minItems": max_tokens // 8 + 1, "items": section}}
    )


def validity_prompt(case: SchemaCase) -> str:
    return f"{case.task}\nAnswer with JSON only, valid against this JSON Schema:\n{json.dumps(case.schema)}"


ESSAY_TASKS = (
    "Write a detailed, multi-paragraph essay about the history of {}, in sections with headings.",
    "Write a long article about {}, in several sections, each with a heading.",
    "Write a detailed guide to {}, in sections with headings and full paragraphs.",
    "Write a long report on {}, split into titled sections.",
)


def essay_prompts(count: int, offset: int) -> list[str]:
    """`count` distinct essay prompts, starting at `offset` (each round and arm takes fresh ones)."""
    prompts = []
    for index in range(offset, offset + count):
        task = ESSAY_TASKS[(index // len(TOPICS)) % len(ESSAY_TASKS)].format(TOPICS[index % len(TOPICS)])
        cycle = index // (len(TOPICS) * len(ESSAY_TASKS))
        prompts.append(task + (f" (Part {cycle + 1}.)" if cycle else ""))
    return prompts


def check_reply(content: str, schema: dict[str, Any]) -> tuple[bool, bool, str | None]:
    """Whether `content` parses as JSON and is valid against `schema` (its own draft), and if not, why."""
    import jsonschema

    try:
        value = json.loads(content)
    except json.JSONDecodeError as error:
        return False, False, f"not JSON: {error}"
    failure = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    if failure is not None:
        where = "/".join(str(part) for part in failure.absolute_path) or "(root)"
        return True, False, f"invalid at {where}: {failure.message}"
    return True, True, None


# ---------------------------------------------------------------- (a) validity


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One validity request and what came back; `unfenced`: after stripping a Markdown code fence."""

    index: int
    schema: str
    finish_reason: str | None = None
    completion_tokens: int | None = None
    seconds: float = 0.0
    parses: bool = False
    parses_unfenced: bool = False
    valid: bool = False
    valid_unfenced: bool = False
    error: str | None = None  # the request failed (an HTTP error): neither parsed nor valid
    problem: str | None = None  # why it does not parse or validate
    content: str = ""  # its start


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidityRun:
    server: str
    replies: list[Reply]
    wall_s: float


async def ask_validity(client: openai.AsyncOpenAI, model: str, index: int, args: argparse.Namespace) -> Reply:
    case = SCHEMAS[index % len(SCHEMAS)]
    extra: dict[str, Any] = {"temperature": VALIDITY_TEMPERATURE, "seed": args.seed + index}
    extra["response_format"] = json_schema_format(case.name, case.schema)
    try:
        reply = await stream_chat(client, model, user(validity_prompt(case)), max_tokens=args.max_tokens, **extra)
    except openai.APIStatusError as error:
        return Reply(index=index, schema=case.name, error=f"HTTP {error.status_code}: {shown(str(error.message))}")
    parses, valid, problem = check_reply(reply.text, case.schema)
    found = FENCE.search(reply.text)
    unfenced = (parses, valid) if valid else check_reply(found.group(1) if found else reply.text.strip(), case.schema)
    return Reply(
        index=index,
        schema=case.name,
        finish_reason=reply.finish_reason,
        completion_tokens=reply.completion_tokens,
        seconds=reply.total_s,
        parses=parses,
        parses_unfenced=unfenced[0],
        valid=valid,
        valid_unfenced=unfenced[1],
        problem=problem,
        content=shown(reply.text),
    )


async def measure_validity(server: Server, args: argparse.Namespace) -> ValidityRun:
    gate = asyncio.Semaphore(args.streams)

    async def one(client: openai.AsyncOpenAI, index: int) -> Reply:
        async with gate:
            return await ask_validity(client, server.spec.model, index, args)

    async with async_client(server.base_url) as client:
        await stream_chat(client, server.spec.model, user(models.WARMUP_PROMPT), max_tokens=8)
        progress(f"{server.spec.name}: validity, {args.requests} requests, {args.streams} at a time")
        started = time.perf_counter()
        replies = list(await asyncio.gather(*(one(client, index) for index in range(args.requests))))
    return ValidityRun(server=server.spec.name, replies=replies, wall_s=time.perf_counter() - started)


def validity_cells(replies: Sequence[Reply]) -> str:
    """requests | errors | finished | cut by length | parses | valid | valid among finished | parses, unfenced |
    valid, unfenced | mean tokens"""
    n, finished = len(replies), [r for r in replies if r.finish_reason == "stop"]
    cut = sum(r.finish_reason == "length" for r in replies)
    tokens = [r.completion_tokens for r in replies if r.completion_tokens is not None]

    def share(count: int, total: int) -> str:
        return percent(count / total if total else None, 0)

    return (
        f"{n} | {sum(bool(r.error) for r in replies)} | {len(finished)} | {share(cut, n)} "
        f"| {share(sum(r.parses for r in replies), n)} | {share(sum(r.valid for r in replies), n)} "
        f"| {share(sum(r.valid for r in finished), len(finished))} "
        f"| {share(sum(r.parses_unfenced for r in replies), n)} | {share(sum(r.valid_unfenced for r in replies), n)} "
        f"| {f'{statistics.fmean(tokens):.0f}' if tokens else '-'}"
    )


def print_validity(runs: Sequence[ValidityRun]) -> None:
    print("### (a) Validity\n")
    print(
        f"Chat `response_format` json_schema (strict), temperature {VALIDITY_TEMPERATURE}, the schema also in the "
        "prompt. Valid = parses and validates (`jsonschema`); unfenced = after stripping a Markdown code fence.\n"
    )
    table(
        "server | requests | errors | finished | cut by length | parses as JSON | valid | valid among finished "
        "| parses, unfenced | valid, unfenced | mean tokens | wall s",
        (f"{run.server} | {validity_cells(run.replies)} | {run.wall_s:.1f}" for run in runs),
    )
    print("Per schema, valid / requests (cut by length):\n")

    def cell(run: ValidityRun, schema: str) -> str:
        mine = [reply for reply in run.replies if reply.schema == schema]
        cut = sum(reply.finish_reason == "length" for reply in mine)
        return f"{sum(reply.valid for reply in mine)}/{len(mine)} ({cut})" if mine else "-"

    rows = [[case.name, *(cell(run, case.name) for run in runs)] for case in SCHEMAS]
    table("schema | " + " | ".join(run.server for run in runs), (" | ".join(r) for r in rows if set(r[1:]) != {"-"}))
    for run in runs:
        if run.server == COURIER:
            finished = [reply for reply in run.replies if reply.finish_reason == "stop"]
            valid = sum(reply.valid for reply in finished) / len(finished) if finished else None
            met = valid is not None and valid >= TARGET_VALID_AMONG_FINISHED
            text = percent(valid, missing="n/a (none finished)")
            print(f"- Courier valid among finished replies: {text} ({'meets' if met else 'misses'} target 100%)")
            for reply in [reply for reply in finished if not reply.valid][:5]:
                print(f"  - #{reply.index} {reply.schema}: {reply.error or reply.problem}: {inline(reply.content)}")
    for run in runs:
        if (sample := next((reply for reply in run.replies if reply.error is None), None)) is not None:
            where = f"#{sample.index}, {sample.schema}, {sample.finish_reason}"
            print(f"- a reply from {run.server} ({where}): {inline(sample.content)}")
        if errors := [reply for reply in run.replies if reply.error is not None]:
            print(f"- {run.server}: {len(errors)} requests failed, first: {errors[0].error}")
    print()


# ---------------------------------------------------------------- (b) throughput


async def measure_throughput(server: Server, args: argparse.Namespace) -> list[Round]:
    """After a warm-up of each arm, `--rounds` rounds of `--streams` requests, constrained then free, each round
    and arm with prompts of its own."""
    schema, prompts = essay_schema(args.max_tokens), iter(essay_prompts(args.streams * 2 * (args.rounds + 1), 0))
    rounds: list[Round] = []

    async def one(client: openai.AsyncOpenAI, arm: str, index: int) -> Round:
        constrained = arm == "constrained"
        extra: dict[str, Any] = {"temperature": THROUGHPUT_TEMPERATURE, "max_tokens": args.max_tokens}
        extra["response_format"] = json_schema_format("essay", schema) if constrained else openai.omit
        asked = [user(next(prompts)) for _ in range(args.streams)]
        done = await burst([stream_chat(client, server.spec.model, messages, **extra) for messages in asked])
        valid = sum(check_reply(s.text, schema)[1] for s in done.streams) if constrained else None
        return Round(arm=arm, index=index, burst=done, valid_json=valid)

    async with async_client(server.base_url) as client:
        progress(f"courier: throughput warm-up, {args.streams} streams free then constrained")
        await one(client, "free", 0)
        await one(client, "constrained", 0)
        for index in range(1, args.rounds + 1):
            for arm in ("constrained", "free"):
                rounds.append(await one(client, arm, index))
                b = rounds[-1].burst
                progress(f"courier: round {index} {arm}: {b.completion_tokens} tokens in {b.wall_s:.2f} s")
    return rounds


def print_throughput(rounds: Sequence[Round], args: argparse.Namespace) -> None:
    print("### (b) Throughput, constrained against free text (Courier)\n")
    print(
        f"{args.streams} concurrent requests a round, temperature {THROUGHPUT_TEMPERATURE}, max_tokens "
        f"{args.max_tokens}; constrained: json_schema with at least {args.max_tokens // 8 + 1} sections "
        "(its shortest valid output exceeds the cap). Rounds alternate constrained, free.\n"
    )
    table("round | arm | tokens | tokens per stream | capped | wall s | tok/s", (r.cells() for r in rounds))
    constrained, free = pooled_tps(rounds, "constrained"), pooled_tps(rounds, "free")
    ratio = constrained / free
    per_round = [c.burst.tps / f.burst.tps for c, f in zip(rounds[::2], rounds[1::2], strict=True)]

    def mean_tokens(arm: str) -> float:
        return statistics.fmean(t for r in rounds if r.arm == arm for t in r.burst.tokens_per_stream)

    print(
        f"- pooled: constrained {constrained:.1f} tok/s, free {free:.1f} tok/s; **constrained / free = {ratio:.3f}** "
        f"({'meets' if ratio >= TARGET_THROUGHPUT_RATIO else 'misses'} target >= {TARGET_THROUGHPUT_RATIO}); "
        f"per round: {', '.join(f'{value:.3f}' for value in per_round)}"
    )
    print(
        f"- mean completion tokens per stream: constrained {mean_tokens('constrained'):.1f}, "
        f"free {mean_tokens('free'):.1f}\n"
    )


# ---------------------------------------------------------------- (c) micro-benchmarks


@dataclass(frozen=True, slots=True, kw_only=True)
class Micro:
    """In process: the grammar tokenizer's build, per schema the constraint's build, a cold compile and a cached
    matcher (medians, ms), mask fills before every token of the instances, one constrained sequence's path (ms)."""

    vocab_size: int
    eos_tokens: list[int]
    tokenizer_build_s: float
    compiles: list[dict[str, Any]]
    fills: list[dict[str, Any]]
    step_ms: list[float]
    compiler_stats: dict[str, Any]

    @property
    def failed(self) -> bool:
        """A token of a valid instance refused, or end-of-sequence not allowed after one."""
        return any(fill["refused"] or fill["eos_refused"] for fill in self.fills)


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def median_ms(calls: Sequence[Callable[[], object]]) -> float:
    return statistics.median(timed(call) for call in calls) * 1000


def time_compiles(compiler: Any, tokens: dict[str, list[int]], repeats: int) -> list[dict[str, Any]]:
    from courier.grammar.compiler import GrammarCompiler
    from courier.grammar.constraint import json_schema

    rows = []
    for case in SCHEMAS:
        build = partial(json_schema, case.schema, name=case.name, param="response_format.json_schema.schema")
        constraint = build()
        figures = {"constraint_build_ms": median_ms([build] * repeats)}
        cold = [partial(GrammarCompiler(compiler.tokenizer).matcher, constraint) for _ in range(repeats)]
        figures["compile_cold_ms"] = median_ms(cold)
        compiler.matcher(constraint)  # now cached
        figures["matcher_cached_ms"] = median_ms([partial(compiler.matcher, constraint)] * repeats)
        grammar = {"schema": case.name, "grammar_bytes": len(constraint.grammar)}
        rows.append(grammar | figures | {"instance_tokens": len(tokens[case.name])})
    return rows


@dataclass(slots=True)
class Lane:
    """One sequence of the micro-benchmark's batch: going through the instances, a fresh matcher for each."""

    row: int
    order: list[int]  # indices into SCHEMAS, in the order this lane takes them
    instance: int = -1  # position in `order`
    position: int = 0  # next token of the current instance
    matcher: Any = None


def time_fills(
    compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]], lanes: int, passes: int
) -> dict[str, Any]:
    """Fill masks before every token of every instance (and its end-of-sequence), `lanes` sequences at once, each
    `passes` times over the instances; stops when the first lane is done (the batch stays full)."""
    from courier.engine.constrained import MaskFiller

    streams = [[*instance, compiler.eos_tokens[0]] for instance in tokens]
    filler = MaskFiller(compiler.vocab_size, lanes)
    order = [[(lane + step) % len(streams) for step in range(len(streams))] * passes for lane in range(lanes)]
    batch = [Lane(row=filler.acquire(), order=each) for each in order]
    refused = eos_refused = fed = 0

    def next_instance(lane: Lane) -> bool:
        lane.instance, lane.position = lane.instance + 1, 0
        if lane.instance >= len(lane.order):
            return False
        lane.matcher = compiler.matcher(constraints[lane.order[lane.instance]])
        return True

    running = all(next_instance(lane) for lane in batch)
    filler.fill_seconds.clear()
    filler.fill_rows.clear()
    while running:
        for lane in batch:
            filler.due(lane.row, lane.matcher)
        for lane in batch:
            stream = streams[lane.order[lane.instance]]
            token, is_eos = stream[lane.position], lane.position == len(stream) - 1
            mask = filler.row(lane.row)  # None: not filled within the fill budget, so nothing allowed
            allowed = mask is not None and bool((int(mask[token // 32]) >> (token % 32)) & 1)
            eos_refused += is_eos and not allowed
            refused += not is_eos and not allowed
            fed, lane.position = fed + 1, lane.position + 1
            if is_eos or not allowed or not lane.matcher.consume_token(token):
                running = next_instance(lane) and running
    fills = list(filler.fill_seconds)
    per_token = [seconds / count for seconds, count in zip(fills, filler.fill_rows, strict=True)]
    return {
        **{"sequences": lanes, "fills": len(fills), "tokens": fed},
        **{f"fill_p{q}_ms": percentile(fills, q / 100) * 1000 for q in (50, 99)},
        "fill_mean_ms": statistics.fmean(fills) * 1000,
        **{f"per_token_p{q}_us": percentile(per_token, q / 100) * 1e6 for q in (50, 99)},
        **{"refused": refused, "eos_refused": eos_refused},
    }


def time_steps(loaded: Any, compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]]) -> list[float]:
    """`ConstrainedSequence.process` + `.sample` before every token of every instance (and its end-of-sequence),
    one sequence, evaluated: the host-side cost a constrained sequence adds to each decode step (ms)."""
    import mlx.core as mx

    from courier.engine.constrained import ConstrainedSequence, MaskFiller

    logprobs = mx.random.normal((1, compiler.vocab_size))
    mx.eval(logprobs)
    milliseconds = []
    for constraint, instance in zip(constraints, tokens, strict=True):
        sequence = ConstrainedSequence(
            constraint,
            compiler=compiler,
            filler=MaskFiller(compiler.vocab_size, 1),
            decode=loaded.tokenizer.decode,
            prompt_length=0,
            sampler=lambda values: mx.argmax(values, axis=-1),
            eos_tokens=compiler.eos_tokens,
        )
        stream = [*instance, compiler.eos_tokens[0]]
        for position in range(len(stream)):
            context = mx.array(stream[:position], dtype=mx.int32)
            mx.eval(context)
            started = time.perf_counter()
            sequence.process(context, logprobs)
            mx.eval(sequence.sample(logprobs))
            milliseconds.append((time.perf_counter() - started) * 1000)
        sequence.release()
    return milliseconds


def measure_micro(loaded: Any, args: argparse.Namespace) -> Micro:
    from courier.grammar.compiler import DEFAULT_CAPACITY
    from courier.grammar.constraint import json_schema
    from courier.model.loader import grammar_compiler

    progress("micro: building the grammar tokenizer")
    started = time.perf_counter()
    compiler = grammar_compiler(loaded, capacity=DEFAULT_CAPACITY)
    tokenizer_build_s = time.perf_counter() - started
    if compiler is None:
        raise BenchmarkError("grammar_compiler() gave no compiler for the embedded model")
    encode = loaded.tokenizer.encode
    tokens = {case.name: list(encode(json.dumps(case.instance), add_special_tokens=False)) for case in SCHEMAS}
    progress(f"micro: compile times, {args.micro_repeats} repeats per schema")
    compiles = time_compiles(compiler, tokens, args.micro_repeats)
    constraints = [json_schema(case.schema, name=case.name, param="micro") for case in SCHEMAS]
    instances = [tokens[case.name] for case in SCHEMAS]
    fills = []
    for lanes in sorted({1, args.micro_sequences}):
        progress(f"micro: mask fills, {lanes} sequence(s), {args.micro_passes} passes")
        fills.append(time_fills(compiler, constraints, instances, lanes, args.micro_passes))
    progress("micro: ConstrainedSequence per-token path, 1 sequence")
    return Micro(
        vocab_size=compiler.vocab_size,
        eos_tokens=list(compiler.eos_tokens),
        tokenizer_build_s=tokenizer_build_s,
        compiles=compiles,
        fills=fills,
        step_ms=time_steps(loaded, compiler, constraints, instances),
        compiler_stats=asdict(compiler.stats()),
    )


def print_micro(micro: Micro) -> None:
    print("### (c) Micro-benchmarks (in process, no server)\n")
    print(
        f"Vocabulary {micro.vocab_size}, end-of-sequence {micro.eos_tokens}; grammar tokenizer built in "
        f"{micro.tokenizer_build_s:.2f} s (`grammar_compiler(loaded, capacity)`, once per model).\n"
    )
    table(
        "schema | grammar bytes | constraint build ms | compile cold ms | matcher cached ms | instance tokens",
        (
            f"{c['schema']} | {c['grammar_bytes']} | {c['constraint_build_ms']:.2f} | {c['compile_cold_ms']:.2f} "
            f"| {c['matcher_cached_ms']:.3f} | {c['instance_tokens']}"
            for c in micro.compiles
        ),
    )
    print("Mask fill before each token (`MaskFiller`, llguidance's parallel fill), end-of-sequence included:\n")
    table(
        "sequences | fills | tokens | fill p50 ms | fill p99 ms | fill mean ms | per token p50 us | per token p99 us "
        "| tokens refused | EOS refused",
        (
            f"{f['sequences']} | {f['fills']} | {f['tokens']} | {f['fill_p50_ms']:.3f} | {f['fill_p99_ms']:.3f} "
            f"| {f['fill_mean_ms']:.3f} | {f['per_token_p50_us']:.0f} | {f['per_token_p99_us']:.0f} | {f['refused']} "
            f"| {f['eos_refused']}"
            for f in micro.fills
        ),
    )
    step = micro.step_ms
    print(
        f"- one constrained sequence's whole per-token path (`ConstrainedSequence.process` + `.sample`, mask to "
        f"MLX, evaluated), {len(step)} tokens: p50 {percentile(step, 0.5):.3f} ms, p99 {percentile(step, 0.99):.3f} "
        f"ms, mean {statistics.fmean(step):.3f} ms"
    )
    print(f"- compiler stats: {micro.compiler_stats}\n")


# ---------------------------------------------------------------- main


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    servers: list[ServerRecord] = field(default_factory=list)
    validity: list[ValidityRun] = field(default_factory=list)
    throughput: list[Round] = field(default_factory=list)
    micro: Micro | None = None
    micro_error: str | None = None


def print_servers(records: Sequence[ServerRecord]) -> None:
    """Each server, and the problems its log shows (Courier: tokens the grammar refused, never if masks are right)."""
    print("### Servers\n")
    for record in records:
        print(record.line())
        log = Path(record.log_path).read_text(errors="replace").splitlines()
        problems = [line for line in log if LOG_PROBLEM.search(line)]
        if record.name == COURIER:
            refused = sum("refused by the grammar" in line for line in problems)
            print(f"  - tokens refused by the grammar (log): {refused}")
        for line in problems[:LOG_PROBLEMS_SHOWN]:
            print(f"  - log: {inline(shown(line))}")
    print()


def print_report(report: Report, args: argparse.Namespace) -> None:
    head("Courier structured outputs benchmark", report.environment, report.settings, "llguidance")
    if report.servers:
        print_servers(report.servers)
    if report.validity:
        print_validity(report.validity)
    if report.throughput:
        print_throughput(report.throughput, args)
    if report.micro is not None:
        print_micro(report.micro)
    if report.micro_error is not None:
        print(f"### Micro-benchmarks\n\nFAILED: {report.micro_error}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(PARTS), help="validity,throughput,micro (all)")
    add("--requests", type=cli.positive_int, default=50, help="validity: requests per server (50)")
    add("--streams", type=cli.positive_int, default=8, help="concurrent requests: validity and throughput (8)")
    add("--rounds", type=cli.positive_int, default=3, help="throughput: rounds of each arm (3)")
    add("--max-tokens", type=cli.positive_int, default=160, help="max_tokens of every request (160)")
    add("--seed", type=int, default=0, help="validity: request i gets seed SEED+i (0)")
    add("--micro-repeats", type=cli.positive_int, default=5, help="micro: compiles timed per schema (5)")
    add("--micro-passes", type=cli.positive_int, default=3, help="micro: passes over the instances per lane (3)")
    add("--micro-sequences", type=cli.positive_int, default=8, help="micro: sequences filled together (8; 1 always)")
    add("--no-peer", dest="peer", action="store_false", help="validity: leave out mlx_lm.server")
    cli.add_results(parser, openblas=MLX_LM_F32)
    return parser.parse_args(argv)


def prepare(cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """Load the model in process when a part needs it: the micro-benchmarks run on it, and the peer's float32
    directory is written from it. Returns that directory (None without a peer)."""
    peer = "validity" in args.parts and args.peer
    if not peer and "micro" not in args.parts:
        return None
    progress("converting the embedded GGUF and loading it as Courier does")
    dir4 = models.prepare_4bit_dir(cache_dir)
    loaded = models.load_served_model(cache_dir)
    dir_f32 = models.float32_dir(dir4, cache_dir, loaded.model) if peer else None
    if "micro" in args.parts:
        try:
            report.micro = measure_micro(loaded, args)
        except (BenchmarkError, ValueError, RuntimeError) as error:
            report.micro_error = f"{type(error).__name__}: {error}"
            progress(f"micro: FAILED: {report.micro_error}")
    del loaded
    models.release_mlx_memory()
    return dir_f32


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if servers.openblas_missing(args.openblas, "validity" in args.parts and args.peer, "--no-peer"):
        return 2
    for case in SCHEMAS:  # the micro-benchmark's tokens are meant to be allowed
        if not check_reply(json.dumps(case.instance), case.schema)[1]:
            raise BenchmarkError(f"the instance of schema {case.name!r} is not valid against it")
    # Before anything imports MLX, so the in-process model runs on OpenBLAS with the kernels Courier picks.
    os.environ.pop("OPENBLAS_CORETYPE", None)
    blas = load_optimized_blas()
    keys = ["parts", "requests", "streams", "rounds", "max_tokens", "seed", "peer"]
    keys += ["micro_repeats", "micro_passes", "micro_sequences"] if "micro" in args.parts else []
    settings = {key: getattr(args, key) for key in keys}
    report = Report(environment=environment(blas, "llguidance", "jsonschema"), settings=settings)
    with models.cache_directory(args.cache_dir) as cache_dir:
        dir_f32 = prepare(cache_dir, args, report)
        launcher = Launcher(
            bench="structured", cache_dir=cache_dir, log_dir=cache_dir / "bench-logs", openblas=args.openblas
        )

        def on_courier(server: Server) -> None:
            if "validity" in args.parts:
                report.validity.append(asyncio.run(measure_validity(server, args)))
            if "throughput" in args.parts:
                report.throughput = asyncio.run(measure_throughput(server, args))

        if "validity" in args.parts or "throughput" in args.parts:
            launcher.run(ServerSpec(name=COURIER), on_courier)
        if dir_f32 is not None:
            peer = ServerSpec(name=MLX_LM_F32, model_dir=dir_f32, flags=servers.tuned_flags(args.streams))
            launcher.run(peer, lambda server: report.validity.append(asyncio.run(measure_validity(server, args))))
        report.servers = launcher.records
        print_report(report, args)
    write_json(report, args.json)
    failed = any(record.error for record in report.servers) or report.micro_error is not None
    return 1 if failed or (report.micro is not None and report.micro.failed) else 0


if __name__ == "__main__":
    sys.exit(main())
