"""Structured outputs (constrained decoding) on the embedded SmolLM2-135M-Instruct: validity, cost and the grammar's
own work, with mlx_lm.server beside Courier on the same checkpoint.

Three parts (`--parts`, all by default):

- `validity`: `--requests` chat completions (50) spread over ten JSON schemas (nested objects, arrays with
  bounds, enums, patterns, anyOf, $ref, additionalProperties false, optional and nullable fields; every string,
  array and number bounded, so a reply can finish), each asked as `response_format: {"type": "json_schema",
  "json_schema": {"name", "schema", "strict": true}}` at temperature 1.0 (seed `--seed` + the request's index) with
  `max_tokens` `--max-tokens` (160), `--streams` (8) in flight at a time. The user message gives the task and
  the schema's text, so a server that ignores `response_format` (mlx_lm.server does) still knows what is
  asked. The same requests go to Courier and to mlx_lm.server. For each server: the share of replies whose
  content parses as JSON (as it is; and, for the record, after stripping a Markdown code fence), the share that
  is valid against its schema (the `jsonschema` package, the schema's own draft), and the share cut by
  `max_tokens` (finish_reason "length"). Courier's target: 100% valid among the replies that finished. Courier's
  log is read afterwards: a line saying the grammar refused a sampled token means a mask let it through.
- `throughput`: on the same Courier server, `--streams` concurrent non-streaming requests (temperature 0,
  `max_tokens` `--max-tokens`, distinct essay prompts), every one constrained by a `json_schema` (a title and
  an array of at least max_tokens / 8 + 1 sections of a heading and a text, strings bounded to 60-300
  characters: its shortest valid output is longer than the cap, so each
  constrained reply runs to the cap) against the same kind of requests as free text. Rounds alternate,
  constrained then free, `--rounds` times (3), each round with prompts of its own (no prompt cache advantage
  for either arm), after a warm-up of each arm. A round's aggregate is its completion tokens (from `usage`:
  there is no `ignore_eos`) / wall time (first request sent .. last answer received, the short prompts' prefill
  included for both arms alike). The ratio constrained / free, pooled over the rounds, is the cost of the
  grammar (target: >= 0.90, i.e. at most 10% slower). Token counts and capped replies are reported beside it:
  a free reply that ends early shrinks its batch, which the ratio would then misread.
- `micro`: in this process, no server. The model as Courier loads it (`courier.model.loader.load_model`), its
  grammar tokenizer from `grammar_compiler(loaded, capacity=...)` (timed), then for each of the ten schemas:
  the constraint's build (`grammar.constraint.json_schema`: schema to grammar, checked), the compile cold (a
  fresh `GrammarCompiler` each time: grammar plus the 49k vocabulary into a matcher) and cached (`matcher()` on
  a warm cache: a copy), medians of `--micro-repeats` (5). Then the mask fill per token, driving llguidance
  matchers through real tokens: each schema has a valid instance, written as Courier's grammar writes JSON
  (`json.dumps`' separators), tokenized by the model's tokenizer and followed by end-of-sequence; before each
  token the mask is filled with `courier.engine.constrained.MaskFiller` (its `fill_seconds` / `fill_rows`) and
  must allow that token. With 1 sequence, and with 8 at once (8 lanes going through the instances from
  different starting schemas, one fill for all 8 rows a step, as in a batch of 8), `--micro-passes` (3) times
  over the instances; p50 and p99 per fill and per token. For the record, the whole per-token path of one
  constrained sequence (`ConstrainedSequence.process` + `.sample` on 49k logits, mask to MLX included).

Servers, each on a free port, polled until ready, measured and stopped, one at a time (micro first, with no
server running):

- `courier`: `courier serve --port P --cache-dir C`, out of the box (on CPU: float32 weights, OpenBLAS).
- `mlx-lm-f32` (validity only): `python -m mlx_lm.server --model DIR --port P --decode-concurrency S
  --prompt-concurrency S --log-level WARNING` with `LD_PRELOAD=<OpenBLAS>`, DIR the 4-bit conversion of the
  embedded GGUF dequantized to float32 (the weights Courier serves), exactly as `bench/throughput.py` runs it.
  `--no-peer` leaves it out.

From the repository root:

    .venv/bin/python -m bench.structured [--parts validity,throughput,micro] [--requests 50] [--streams 8]
        [--rounds 3] [--max-tokens 160] [--micro-repeats 5] [--micro-passes 3] [--seed 0] [--no-peer]
        [--cache-dir DIR] [--openblas PATH] [--json PATH]

Markdown goes to stdout, progress to stderr, server logs to CACHE/bench-logs (kept when --cache-dir is given).
The exit code is 1 when a server failed or a micro check did not hold (a token of a valid instance refused, or
end-of-sequence not allowed after it), else 0; targets missed are reported, not failed.
"""

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
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema

from bench.throughput import (
    COURIER,
    COURIER_MODEL_ID,
    HOST,
    MLX_LM_F32,
    MLX_LM_MODEL_ID,
    OPENBLAS_PATH,
    TOPICS,
    WARMUP_PROMPT,
    BenchmarkError,
    cache_directory,
    environment,
    free_port,
    percentile,
    prepare_4bit_dir,
    progress,
    ready_path,
    release_mlx_memory,
    running_server,
    save_float32_dir,
    server_command,
    server_env,
    server_extra_env,
    wait_until_ready,
)
from courier.platform.blas import BlasReport, load_optimized_blas

PARTS = ("validity", "throughput", "micro")
REQUEST_TIMEOUT_S = 900.0
TARGET_VALID_AMONG_FINISHED = 1.0
TARGET_THROUGHPUT_RATIO = 0.90
SHOWN_CHARS = 240
FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
VALIDITY_TEMPERATURE = 1.0
THROUGHPUT_TEMPERATURE = 0.0
RUN_ERRORS = (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError)
LOG_PROBLEM = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback")
LOG_PROBLEMS_SHOWN = 5

# ---------------------------------------------------------------- schemas


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
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else list(required),
        "additionalProperties": False,
    }


def _string(max_length: int, min_length: int = 0) -> dict[str, Any]:
    bounds: dict[str, Any] = {"type": "string", "maxLength": max_length}
    if min_length:
        bounds["minLength"] = min_length
    return bounds


def _integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


POINT_REF = {"$ref": "#/$defs/point"}
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        name="person",
        task="Invent a person: their name, age and email address.",
        schema=_object(
            {
                "name": _string(40, 1),
                "age": _integer(0, 120),
                "email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)$"},
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
                        "postcode": {"type": "string", "pattern": r"^[0-9]{5}$"},
                        "country": {"type": "string", "enum": ["FR", "DE", "ES", "IT", "NL", "PT"]},
                    }
                ),
                "express": {"type": "boolean"},
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
        schema=_object(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": _object({"item": _string(30, 1), "quantity": _integer(1, 20)}),
                }
            }
        ),
        instance={"items": [{"item": "flour", "quantity": 1}, {"item": "eggs", "quantity": 6}]},
    ),
    SchemaCase(
        name="sentiment",
        task="Classify the sentiment of this review: 'The soup was cold but the staff were lovely.'",
        schema=_object(
            {
                "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral", "mixed"]},
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
                "color": {"type": "string", "enum": ["red", "green", "blue", "black"]},
            }
        ),
        instance={"shape": {"kind": "rectangle", "width": 40, "height": 25}, "color": "blue"},
    ),
    SchemaCase(
        name="route",
        task="Plan a short route on a grid: where it starts, where it ends, and up to three points on the way.",
        schema={
            "$defs": {"point": _object({"x": _integer(-100, 100), "y": _integer(-100, 100)})},
            **_object(
                {
                    "start": POINT_REF,
                    "end": POINT_REF,
                    "waypoints": {"type": "array", "maxItems": 3, "items": POINT_REF},
                }
            ),
        },
        instance={"start": {"x": 0, "y": 0}, "end": {"x": 10, "y": -4}, "waypoints": [{"x": 5, "y": 2}]},
    ),
    SchemaCase(
        name="article",
        task="Give the title of a blog post about learning to cook, a few tags for it, and whether it is published.",
        schema=_object(
            {
                "title": _string(60, 3),
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {"type": "string", "pattern": r"^[a-z]{2,12}$"},
                },
                "published": {"type": "boolean"},
            }
        ),
        instance={"title": "Cooking for beginners", "tags": ["cooking", "food"], "published": False},
    ),
    SchemaCase(
        name="event",
        task="Schedule a team meeting next year: what it is, its date, its start time and how many attend.",
        schema=_object(
            {
                "event": _string(40, 1),
                "date": {"type": "string", "pattern": r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
                "time": {"type": "string", "pattern": r"^([01][0-9]|2[0-3]):[0-5][0-9]$"},
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
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": _object({"name": _string(20, 1), "grams": _integer(1, 1000)}),
                },
                "vegetarian": {"type": "boolean"},
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
    """The throughput arm's schema: its shortest valid output (empty strings everywhere) is longer than
    `max_tokens`, so a constrained reply always runs to the cap (a section is at least 8 tokens). Strings are
    bounded, so the model must keep closing them and opening the next key: the grammar's structure is exercised,
    not one endless string."""
    section = _object({"heading": _string(60), "text": _string(300)})
    sections = {"type": "array", "minItems": max_tokens // 8 + 1, "items": section}
    return _object({"title": _string(80), "sections": sections})


def response_format(name: str, schema: dict[str, Any]) -> ResponseFormatJSONSchema:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


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
    prompts: list[str] = []
    for index in range(offset, offset + count):
        topic = TOPICS[index % len(TOPICS)]
        task = ESSAY_TASKS[(index // len(TOPICS)) % len(ESSAY_TASKS)]
        cycle = index // (len(TOPICS) * len(ESSAY_TASKS))
        prompts.append(task.format(topic) + (f" (Part {cycle + 1}.)" if cycle else ""))
    return prompts


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One validity request and what came back."""

    index: int
    schema: str
    finish_reason: str | None
    completion_tokens: int | None
    seconds: float
    parses: bool
    parses_unfenced: bool  # after stripping a Markdown code fence
    valid: bool
    valid_unfenced: bool
    error: str | None = None  # the request failed (HTTP error): counts as neither parsed nor valid
    problem: str | None = None  # why it does not parse or validate
    content: str = ""  # its start

    @property
    def finished(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def cut(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValiditySummary:
    requests: int
    errors: int
    finished: int
    cut_by_length: int
    parses: int
    valid: int
    valid_among_finished: int
    parses_unfenced: int
    valid_unfenced: int
    finish_reasons: dict[str, int]
    completion_tokens_mean: float | None

    @classmethod
    def of(cls, replies: Sequence[Reply]) -> ValiditySummary:
        reasons: dict[str, int] = {}
        for reply in replies:
            key = reply.finish_reason or ("error" if reply.error else "none")
            reasons[key] = reasons.get(key, 0) + 1
        tokens = [reply.completion_tokens for reply in replies if reply.completion_tokens is not None]
        return cls(
            requests=len(replies),
            errors=sum(1 for reply in replies if reply.error),
            finished=sum(1 for reply in replies if reply.finished),
            cut_by_length=sum(1 for reply in replies if reply.cut),
            parses=sum(1 for reply in replies if reply.parses),
            valid=sum(1 for reply in replies if reply.valid),
            valid_among_finished=sum(1 for reply in replies if reply.valid and reply.finished),
            parses_unfenced=sum(1 for reply in replies if reply.parses_unfenced),
            valid_unfenced=sum(1 for reply in replies if reply.valid_unfenced),
            finish_reasons=reasons,
            completion_tokens_mean=statistics.fmean(tokens) if tokens else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidityRun:
    server: str
    summary: ValiditySummary
    per_schema: dict[str, ValiditySummary]
    replies: list[Reply]
    wall_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """One round of one arm: `streams` requests sent together."""

    arm: str  # "constrained" or "free"
    round: int
    streams: int
    completion_tokens: int
    tokens_per_stream: list[int]
    capped: int  # replies cut by max_tokens
    wall_s: float
    tps: float
    valid_json: int | None = None  # constrained arm: replies that parse and validate (cut ones never do)


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputResult:
    max_tokens: int
    streams: int
    min_sections: int
    rounds: list[RoundResult]
    constrained_tps: float  # pooled: all tokens / all wall time of the arm's rounds
    free_tps: float
    ratio: float  # constrained / free, pooled
    round_ratios: list[float]  # each round's constrained / free
    constrained_tokens_mean: float
    free_tokens_mean: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileTiming:
    schema: str
    grammar_bytes: int
    constraint_build_ms: float  # json_schema(): schema to grammar text, validated
    compile_cold_ms: float  # matcher() on a fresh GrammarCompiler (median)
    compile_cold_runs_ms: list[float]
    matcher_cached_ms: float  # matcher() on a warm cache: a copy (median)
    instance_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FillTiming:
    """Mask fills before each token of the instances (their end-of-sequence included)."""

    sequences: int
    fills: int
    tokens: int
    fill_p50_ms: float
    fill_p99_ms: float
    fill_mean_ms: float
    per_token_p50_us: float  # a fill's time over the rows it filled
    per_token_p99_us: float
    refused: int  # instance tokens the mask did not allow (must be 0)
    eos_refused: int  # instances after which end-of-sequence was not allowed (must be 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTiming:
    """One constrained sequence's whole per-token path: `process` (advance the matcher) + `sample` (fill the mask,
    turn it into an MLX mask over the logits, sample), evaluated."""

    tokens: int
    p50_ms: float
    p99_ms: float
    mean_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroResult:
    vocab_size: int
    eos_tokens: list[int]
    tokenizer_build_s: float
    compiles: list[CompileTiming]
    fills: list[FillTiming]
    step: StepTiming | None
    compiler_stats: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class ServerRun:
    name: str
    command: list[str]
    extra_env: dict[str, str]
    log_path: str = ""
    ready_s: float | None = None
    error: str | None = None
    log_problems: list[str] = field(default_factory=list)  # WARNING / ERROR / traceback lines, the first few
    grammar_refusals: int = 0  # log lines saying the grammar refused a sampled token


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    servers: list[ServerRun] = field(default_factory=list)
    validity: list[ValidityRun] = field(default_factory=list)
    throughput: ThroughputResult | None = None
    micro: MicroResult | None = None
    micro_error: str | None = None


# ---------------------------------------------------------------- checking replies


def check_reply(content: str, schema: dict[str, Any]) -> tuple[bool, bool, str | None]:
    """Whether `content` parses as JSON and is valid against `schema`, and if not, why."""
    import jsonschema

    try:
        value = json.loads(content)
    except json.JSONDecodeError as error:
        return False, False, f"not JSON: {error}"
    validator_class = jsonschema.validators.validator_for(schema)
    failure = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(value))
    if failure is not None:
        where = "/".join(str(part) for part in failure.absolute_path) or "(root)"
        return True, False, f"invalid at {where}: {failure.message}"
    return True, True, None


def unfenced(content: str) -> str:
    """The content of a Markdown code fence, when there is one (what a client might dig out of a free reply)."""
    found = FENCE.search(content)
    return found.group(1) if found else content.strip()


def shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def inline(text: str) -> str:
    """`text` as Markdown inline code on one line."""
    return "`" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("`", "'") + "`"


# ---------------------------------------------------------------- servers


def make_client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://{HOST}:{port}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def model_id(server: str) -> str:
    return COURIER_MODEL_ID if server == COURIER else MLX_LM_MODEL_ID


def run_server(
    server: str,
    model_dir: Path | None,
    cache_dir: Path,
    args: argparse.Namespace,
    report: Report,
    *,
    measure: Callable[[int], None],
) -> None:
    """Start `server`, wait until it is ready, `measure(port)`, stop it; then read its log for problems. A failure
    is recorded in its `ServerRun` (what was measured before it is kept)."""
    port = free_port()
    command = server_command(server, port, cache_dir, model_dir, args.streams)
    extra_env = server_extra_env(server, args.openblas, cache_dir)
    log_path = cache_dir / "bench-logs" / f"structured-{server}.log"
    run = ServerRun(name=server, command=command, extra_env=extra_env, log_path=str(log_path))
    report.servers.append(run)
    env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
    progress(f"{server}: starting {env_text + ' ' if env_text else ''}{' '.join(command)} (log: {log_path})")
    try:
        with running_server(command, server_env(extra_env), log_path) as process:
            run.ready_s = wait_until_ready(process, f"http://{HOST}:{port}{ready_path(server)}", log_path)
            progress(f"{server}: ready after {run.ready_s:.1f} s")
            measure(port)
    except RUN_ERRORS as error:
        run.error = f"{type(error).__name__}: {error}"
        progress(f"{server}: FAILED: {run.error}")
    run.log_problems, run.grammar_refusals = read_log(log_path)


def read_log(log_path: Path) -> tuple[list[str], int]:
    """A server log's WARNING / ERROR / traceback lines (the first few), and how many say a token was refused by
    the grammar (Courier's `ConstrainedSequence` logs one whenever its mask let through a token the matcher then
    refused: never, if masks are right)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return [], 0
    problems = [line for line in lines if LOG_PROBLEM.search(line)]
    refusals = sum(1 for line in problems if "refused by the grammar" in line)
    return [shown(line) for line in problems[:LOG_PROBLEMS_SHOWN]], refusals


async def warm_up(client: openai.AsyncOpenAI, model: str) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": WARMUP_PROMPT}]
    await client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)


# ---------------------------------------------------------------- (a) validity


async def ask_validity(
    client: openai.AsyncOpenAI, model: str, index: int, case: SchemaCase, args: argparse.Namespace
) -> Reply:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": validity_prompt(case)}]
    started = time.perf_counter()
    try:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=VALIDITY_TEMPERATURE,
            seed=args.seed + index,
            response_format=response_format(case.name, case.schema),
        )
    except openai.APIStatusError as error:
        return Reply(
            index=index,
            schema=case.name,
            finish_reason=None,
            completion_tokens=None,
            seconds=time.perf_counter() - started,
            parses=False,
            parses_unfenced=False,
            valid=False,
            valid_unfenced=False,
            error=f"HTTP {error.status_code}: {shown(str(error.message))}",
        )
    seconds = time.perf_counter() - started
    choice = completion.choices[0]
    content = choice.message.content or ""
    parses, valid, problem = check_reply(content, case.schema)
    parses_unfenced, valid_unfenced = parses, valid
    if not valid:
        parses_unfenced, valid_unfenced, _ = check_reply(unfenced(content), case.schema)
    return Reply(
        index=index,
        schema=case.name,
        finish_reason=choice.finish_reason,
        completion_tokens=completion.usage.completion_tokens if completion.usage else None,
        seconds=seconds,
        parses=parses,
        parses_unfenced=parses_unfenced,
        valid=valid,
        valid_unfenced=valid_unfenced,
        problem=problem,
        content=shown(content),
    )


async def measure_validity(server: str, port: int, args: argparse.Namespace) -> ValidityRun:
    model = model_id(server)
    gate = asyncio.Semaphore(args.streams)

    async def one(client: openai.AsyncOpenAI, index: int) -> Reply:
        async with gate:
            return await ask_validity(client, model, index, SCHEMAS[index % len(SCHEMAS)], args)

    async with make_client(port) as client:
        await warm_up(client, model)
        progress(
            f"{server}: validity, {args.requests} requests, {args.streams} at a time, max_tokens {args.max_tokens}"
        )
        started = time.perf_counter()
        replies = list(await asyncio.gather(*(one(client, index) for index in range(args.requests))))
        wall_s = time.perf_counter() - started
    per_schema = {
        case.name: ValiditySummary.of([reply for reply in replies if reply.schema == case.name])
        for case in SCHEMAS
        if any(reply.schema == case.name for reply in replies)
    }
    return ValidityRun(
        server=server, summary=ValiditySummary.of(replies), per_schema=per_schema, replies=replies, wall_s=wall_s
    )


# ---------------------------------------------------------------- (b) throughput


async def run_round(
    client: openai.AsyncOpenAI,
    prompts: Sequence[str],
    schema: dict[str, Any] | None,
    *,
    arm: str,
    round_index: int,
    max_tokens: int,
) -> RoundResult:
    async def one(prompt: str) -> tuple[int, bool, bool]:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
        if schema is None:
            completion = await client.chat.completions.create(
                model=COURIER_MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=THROUGHPUT_TEMPERATURE
            )
        else:
            completion = await client.chat.completions.create(
                model=COURIER_MODEL_ID,
                messages=messages,
                max_tokens=max_tokens,
                temperature=THROUGHPUT_TEMPERATURE,
                response_format=response_format("essay", schema),
            )
        choice = completion.choices[0]
        tokens = completion.usage.completion_tokens if completion.usage else 0
        valid = schema is not None and check_reply(choice.message.content or "", schema)[1]
        return tokens, choice.finish_reason == "length", valid

    started = time.perf_counter()
    answers = await asyncio.gather(*(one(prompt) for prompt in prompts))
    wall_s = time.perf_counter() - started
    tokens = [answer[0] for answer in answers]
    return RoundResult(
        arm=arm,
        round=round_index,
        streams=len(prompts),
        completion_tokens=sum(tokens),
        tokens_per_stream=tokens,
        capped=sum(1 for answer in answers if answer[1]),
        wall_s=wall_s,
        tps=sum(tokens) / wall_s if wall_s > 0 else float("nan"),
        valid_json=sum(1 for answer in answers if answer[2]) if schema is not None else None,
    )


async def measure_throughput(port: int, args: argparse.Namespace) -> ThroughputResult:
    schema = essay_schema(args.max_tokens)
    streams, offset = args.streams, 0
    rounds: list[RoundResult] = []

    def prompts() -> list[str]:
        nonlocal offset
        taken = essay_prompts(streams, offset)
        offset += streams
        return taken

    async with make_client(port) as client:
        progress(f"courier: throughput warm-up, {streams} streams free then constrained")
        await run_round(client, prompts(), None, arm="free", round_index=0, max_tokens=args.max_tokens)
        await run_round(client, prompts(), schema, arm="constrained", round_index=0, max_tokens=args.max_tokens)
        for round_index in range(1, args.rounds + 1):
            for arm, arm_schema in (("constrained", schema), ("free", None)):
                result = await run_round(
                    client, prompts(), arm_schema, arm=arm, round_index=round_index, max_tokens=args.max_tokens
                )
                progress(
                    f"courier: round {round_index} {arm}: {result.completion_tokens} tokens in {result.wall_s:.2f} s "
                    f"= {result.tps:.1f} tok/s"
                )
                rounds.append(result)
    constrained = [result for result in rounds if result.arm == "constrained"]
    free = [result for result in rounds if result.arm == "free"]
    constrained_tps = sum(r.completion_tokens for r in constrained) / sum(r.wall_s for r in constrained)
    free_tps = sum(r.completion_tokens for r in free) / sum(r.wall_s for r in free)
    return ThroughputResult(
        max_tokens=args.max_tokens,
        streams=streams,
        min_sections=schema["properties"]["sections"]["minItems"],
        rounds=rounds,
        constrained_tps=constrained_tps,
        free_tps=free_tps,
        ratio=constrained_tps / free_tps,
        round_ratios=[c.tps / f.tps for c, f in zip(constrained, free, strict=True)],
        constrained_tokens_mean=statistics.fmean(t for r in constrained for t in r.tokens_per_stream),
        free_tokens_mean=statistics.fmean(t for r in free for t in r.tokens_per_stream),
    )


def run_courier(cache_dir: Path, args: argparse.Namespace, report: Report) -> None:
    def measure(port: int) -> None:
        if "validity" in args.parts:
            report.validity.append(asyncio.run(measure_validity(COURIER, port, args)))
        if "throughput" in args.parts:
            report.throughput = asyncio.run(measure_throughput(port, args))

    run_server(COURIER, None, cache_dir, args, report, measure=measure)


def run_peer(dir_f32: Path, cache_dir: Path, args: argparse.Namespace, report: Report) -> None:
    def measure(port: int) -> None:
        report.validity.append(asyncio.run(measure_validity(MLX_LM_F32, port, args)))

    run_server(MLX_LM_F32, dir_f32, cache_dir, args, report, measure=measure)


# ---------------------------------------------------------------- (c) micro-benchmarks


def median_ms(runs: Sequence[float]) -> float:
    return statistics.median(runs) * 1000.0


def time_compiles(loaded: Any, compiler: Any, tokens: dict[str, list[int]], repeats: int) -> list[CompileTiming]:
    from courier.grammar.compiler import GrammarCompiler
    from courier.grammar.constraint import json_schema

    timings: list[CompileTiming] = []
    for case in SCHEMAS:
        builds, cold, cached = [], [], []
        constraint = json_schema(case.schema, name=case.name, param="response_format.json_schema.schema")
        for _ in range(repeats):
            started = time.perf_counter()
            constraint = json_schema(case.schema, name=case.name, param="response_format.json_schema.schema")
            builds.append(time.perf_counter() - started)
            fresh = GrammarCompiler(compiler.tokenizer)
            started = time.perf_counter()
            fresh.matcher(constraint)
            cold.append(time.perf_counter() - started)
        compiler.matcher(constraint)  # now cached
        for _ in range(repeats):
            started = time.perf_counter()
            compiler.matcher(constraint)
            cached.append(time.perf_counter() - started)
        timings.append(
            CompileTiming(
                schema=case.name,
                grammar_bytes=len(constraint.grammar),
                constraint_build_ms=median_ms(builds),
                compile_cold_ms=median_ms(cold),
                compile_cold_runs_ms=[run * 1000.0 for run in cold],
                matcher_cached_ms=median_ms(cached),
                instance_tokens=len(tokens[case.name]),
            )
        )
    return timings


@dataclass(slots=True)
class Lane:
    """One sequence of the micro-benchmark's batch: going through the instances, a fresh matcher for each."""

    row: int
    order: list[int]  # indices into SCHEMAS, in the order this lane takes them
    instance: int = -1  # position in `order`
    position: int = 0  # next token of the current instance
    matcher: Any = None


def time_fills(
    compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]], lanes_count: int, passes: int
) -> FillTiming:
    """Fill masks before every token of every instance (plus its end-of-sequence), `lanes_count` sequences at
    once, each lane `passes` times over the instances; stops when the first lane is done (the batch stays full)."""
    from courier.engine.constrained import MaskFiller

    eos = compiler.eos_tokens[0]
    streams = [[*instance, eos] for instance in tokens]
    filler = MaskFiller(compiler.vocab_size, lanes_count)
    lanes = [
        Lane(row=filler.acquire(), order=[(lane + step) % len(streams) for step in range(len(streams))] * passes)
        for lane in range(lanes_count)
    ]
    refused = eos_refused = fed = 0

    def next_instance(lane: Lane) -> bool:
        lane.instance += 1
        lane.position = 0
        if lane.instance >= len(lane.order):
            return False
        lane.matcher = compiler.matcher(constraints[lane.order[lane.instance]])
        return True

    running = all(next_instance(lane) for lane in lanes)
    filler.fill_seconds.clear()
    filler.fill_rows.clear()
    while running:
        for lane in lanes:
            filler.due(lane.row, lane.matcher)
        for lane in lanes:
            stream = streams[lane.order[lane.instance]]
            token = stream[lane.position]
            mask = filler.row(lane.row)
            allowed = bool((int(mask[token // 32]) >> (token % 32)) & 1)
            is_eos = lane.position == len(stream) - 1
            if not allowed:
                if is_eos:
                    eos_refused += 1
                else:
                    refused += 1
            fed += 1
            lane.position += 1
            if is_eos or not allowed or not lane.matcher.consume_token(token):
                running = next_instance(lane) and running
    fills = list(filler.fill_seconds)
    rows = list(filler.fill_rows)
    per_token = [seconds / count for seconds, count in zip(fills, rows, strict=True)]
    return FillTiming(
        sequences=lanes_count,
        fills=len(fills),
        tokens=fed,
        fill_p50_ms=percentile(fills, 0.50) * 1000.0,
        fill_p99_ms=percentile(fills, 0.99) * 1000.0,
        fill_mean_ms=statistics.fmean(fills) * 1000.0,
        per_token_p50_us=percentile(per_token, 0.50) * 1e6,
        per_token_p99_us=percentile(per_token, 0.99) * 1e6,
        refused=refused,
        eos_refused=eos_refused,
    )


def time_steps(loaded: Any, compiler: Any, constraints: Sequence[Any], tokens: Sequence[list[int]]) -> StepTiming:
    """`ConstrainedSequence.process` + `.sample` before every token of every instance (and its end-of-sequence),
    one sequence, evaluated: the host-side cost a constrained sequence adds to each decode step."""
    import mlx.core as mx

    from courier.engine.constrained import ConstrainedSequence, MaskFiller

    width = compiler.vocab_size
    logprobs = mx.random.normal((1, width))
    mx.eval(logprobs)

    def argmax(values: mx.array) -> mx.array:
        return mx.argmax(values, axis=-1)

    seconds: list[float] = []
    eos = compiler.eos_tokens[0]
    for constraint, instance in zip(constraints, tokens, strict=True):
        filler = MaskFiller(width, 1)
        sequence = ConstrainedSequence(
            constraint,
            compiler=compiler,
            filler=filler,
            decode=loaded.tokenizer.decode,
            prompt_length=0,
            sampler=argmax,
            eos_tokens=compiler.eos_tokens,
        )
        stream = [*instance, eos]
        for position in range(len(stream)):
            context = mx.array(stream[:position], dtype=mx.int32)
            mx.eval(context)
            started = time.perf_counter()
            sequence.process(context, logprobs)
            mx.eval(sequence.sample(logprobs))
            seconds.append(time.perf_counter() - started)
        sequence.release()
    return StepTiming(
        tokens=len(seconds),
        p50_ms=percentile(seconds, 0.50) * 1000.0,
        p99_ms=percentile(seconds, 0.99) * 1000.0,
        mean_ms=statistics.fmean(seconds) * 1000.0,
    )


def measure_micro(loaded: Any, args: argparse.Namespace) -> MicroResult:
    from courier.grammar.compiler import DEFAULT_CAPACITY
    from courier.grammar.constraint import json_schema
    from courier.model.loader import grammar_compiler

    progress("micro: building the grammar tokenizer")
    started = time.perf_counter()
    compiler = grammar_compiler(loaded, capacity=DEFAULT_CAPACITY)
    tokenizer_build_s = time.perf_counter() - started
    if compiler is None:
        raise BenchmarkError("grammar_compiler() gave no compiler for the embedded model")
    tokens = {
        case.name: list(loaded.tokenizer.encode(json.dumps(case.instance), add_special_tokens=False))
        for case in SCHEMAS
    }
    progress(f"micro: compile times, {args.micro_repeats} repeats per schema")
    compiles = time_compiles(loaded, compiler, tokens, args.micro_repeats)
    constraints = [json_schema(case.schema, name=case.name, param="micro") for case in SCHEMAS]
    instances = [tokens[case.name] for case in SCHEMAS]
    fills = []
    for lanes in sorted({1, args.micro_sequences}):
        progress(f"micro: mask fills, {lanes} sequence(s), {args.micro_passes} passes")
        fills.append(time_fills(compiler, constraints, instances, lanes, args.micro_passes))
    progress("micro: ConstrainedSequence per-token path, 1 sequence")
    step = time_steps(loaded, compiler, constraints, instances)
    return MicroResult(
        vocab_size=compiler.vocab_size,
        eos_tokens=list(compiler.eos_tokens),
        tokenizer_build_s=tokenizer_build_s,
        compiles=compiles,
        fills=fills,
        step=step,
        compiler_stats=asdict(compiler.stats()),
    )


def check_instances() -> None:
    """Each schema's instance must be valid against it: the micro-benchmark's tokens are meant to be allowed."""
    for case in SCHEMAS:
        _, valid, problem = check_reply(json.dumps(case.instance), case.schema)
        if not valid:
            raise BenchmarkError(f"the instance of schema {case.name!r} is not valid against it: {problem}")


# ---------------------------------------------------------------- report


def pct(count: int, total: int) -> str:
    return f"{100.0 * count / total:.0f}%" if total else "n/a"


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier structured outputs benchmark\n")
    print(f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, llguidance {env['llguidance']}")
    print(f"- machine: {env['platform']} ({env['machine']}), {env['cpu_count']} CPUs")
    print(f"- settings: {report.settings}\n")
    if report.servers:
        print("### Servers\n")
        for run in report.servers:
            env_text = " ".join(f"{key}={value}" for key, value in run.extra_env.items())
            status = f"ready in {run.ready_s:.1f} s" if run.ready_s is not None else "not ready"
            if run.error is not None:
                status += f"; FAILED: {run.error}"
            print(f"- `{run.name}`: `{(env_text + ' ') if env_text else ''}{' '.join(run.command)}` ({status})")
            if run.name == COURIER:
                print(f"  - tokens refused by the grammar (log): {run.grammar_refusals}")
            for line in run.log_problems:
                print(f"  - log: {inline(line)}")
        print()
    if report.validity:
        print_validity(report.validity)
    if report.throughput is not None:
        print_throughput(report.throughput)
    if report.micro is not None:
        print_micro(report.micro)
    if report.micro_error is not None:
        print(f"### Micro-benchmarks\n\nFAILED: {report.micro_error}\n")


def print_validity(runs: Sequence[ValidityRun]) -> None:
    print("### (a) Validity\n")
    print(
        f"Chat `response_format` json_schema (strict), temperature {VALIDITY_TEMPERATURE}, the schema also in the "
        "prompt. Valid = parses and validates (`jsonschema`); unfenced = after stripping a Markdown code fence.\n"
    )
    print(
        "| server | requests | errors | finished | cut by length | parses as JSON | valid | valid among finished "
        "| parses, unfenced | valid, unfenced | mean tokens | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        s = run.summary
        tokens = f"{s.completion_tokens_mean:.0f}" if s.completion_tokens_mean is not None else "-"
        print(
            f"| {run.server} | {s.requests} | {s.errors} | {s.finished} | {pct(s.cut_by_length, s.requests)} "
            f"| {pct(s.parses, s.requests)} | {pct(s.valid, s.requests)} | {pct(s.valid_among_finished, s.finished)} "
            f"| {pct(s.parses_unfenced, s.requests)} | {pct(s.valid_unfenced, s.requests)} | {tokens} "
            f"| {run.wall_s:.1f} |"
        )
    print()
    print("Per schema, valid / requests (cut by length):\n")
    print("| schema | " + " | ".join(run.server for run in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for case in SCHEMAS:
        cells = []
        for run in runs:
            found = run.per_schema.get(case.name)
            cells.append(f"{found.valid}/{found.requests} ({found.cut_by_length})" if found is not None else "-")
        if any(cell != "-" for cell in cells):
            print(f"| {case.name} | " + " | ".join(cells) + " |")
    print()
    for run in runs:
        if run.server != COURIER:
            continue
        s = run.summary
        share = s.valid_among_finished / s.finished if s.finished else None
        met = share is not None and share >= TARGET_VALID_AMONG_FINISHED
        shown_share = f"{100.0 * share:.1f}%" if share is not None else "n/a (none finished)"
        print(f"- Courier valid among finished replies: {shown_share} ({'meets' if met else 'misses'} target 100%)")
        bad = [reply for reply in run.replies if reply.finished and not reply.valid]
        for reply in bad[:5]:
            print(f"  - #{reply.index} {reply.schema}: {reply.error or reply.problem}: {inline(reply.content)}")
    for run in runs:
        sample = next((reply for reply in run.replies if reply.error is None), None)
        if sample is not None:
            print(
                f"- a reply from {run.server} (#{sample.index}, {sample.schema}, {sample.finish_reason}): "
                f"{inline(sample.content)}"
            )
        errors = [reply for reply in run.replies if reply.error is not None]
        if errors:
            print(f"- {run.server}: {len(errors)} requests failed, first: {errors[0].error}")
    print()


def print_throughput(result: ThroughputResult) -> None:
    print("### (b) Throughput, constrained against free text (Courier)\n")
    print(
        f"{result.streams} concurrent requests a round, temperature {THROUGHPUT_TEMPERATURE}, max_tokens "
        f"{result.max_tokens}; constrained: json_schema with at least {result.min_sections} sections "
        "(its shortest valid output exceeds the cap). Rounds alternate constrained, free.\n"
    )
    print("| round | arm | tokens | tokens per stream | capped | wall s | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in result.rounds:
        per_stream = f"{min(r.tokens_per_stream)}-{max(r.tokens_per_stream)}"
        print(
            f"| {r.round} | {r.arm} | {r.completion_tokens} | {per_stream} | {r.capped}/{r.streams} "
            f"| {r.wall_s:.2f} | {r.tps:.1f} |"
        )
    print()
    met = result.ratio >= TARGET_THROUGHPUT_RATIO
    ratios = ", ".join(f"{ratio:.3f}" for ratio in result.round_ratios)
    print(
        f"- pooled: constrained {result.constrained_tps:.1f} tok/s, free {result.free_tps:.1f} tok/s; "
        f"**constrained / free = {result.ratio:.3f}** ({'meets' if met else 'misses'} target >= "
        f"{TARGET_THROUGHPUT_RATIO}); per round: {ratios}"
    )
    print(
        f"- mean completion tokens per stream: constrained {result.constrained_tokens_mean:.1f}, "
        f"free {result.free_tokens_mean:.1f}\n"
    )


def print_micro(micro: MicroResult) -> None:
    print("### (c) Micro-benchmarks (in process, no server)\n")
    print(
        f"Vocabulary {micro.vocab_size}, end-of-sequence {micro.eos_tokens}; grammar tokenizer built in "
        f"{micro.tokenizer_build_s:.2f} s (`grammar_compiler(loaded, capacity)`, once per model).\n"
    )
    print("| schema | grammar bytes | constraint build ms | compile cold ms | matcher cached ms | instance tokens |")
    print("|---|---|---|---|---|---|")
    for c in micro.compiles:
        print(
            f"| {c.schema} | {c.grammar_bytes} | {c.constraint_build_ms:.2f} | {c.compile_cold_ms:.2f} "
            f"| {c.matcher_cached_ms:.3f} | {c.instance_tokens} |"
        )
    print()
    print("Mask fill before each token (`MaskFiller`, llguidance's parallel fill), end-of-sequence included:\n")
    print(
        "| sequences | fills | tokens | fill p50 ms | fill p99 ms | fill mean ms | per token p50 us | per token p99 us "
        "| tokens refused | EOS refused |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in micro.fills:
        print(
            f"| {f.sequences} | {f.fills} | {f.tokens} | {f.fill_p50_ms:.3f} | {f.fill_p99_ms:.3f} "
            f"| {f.fill_mean_ms:.3f} | {f.per_token_p50_us:.0f} | {f.per_token_p99_us:.0f} | {f.refused} "
            f"| {f.eos_refused} |"
        )
    print()
    if micro.step is not None:
        s = micro.step
        print(
            f"- one constrained sequence's whole per-token path (`ConstrainedSequence.process` + `.sample`, mask to "
            f"MLX, evaluated), {s.tokens} tokens: p50 {s.p50_ms:.3f} ms, p99 {s.p99_ms:.3f} ms, "
            f"mean {s.mean_ms:.3f} ms"
        )
    print(f"- compiler stats: {micro.compiler_stats}\n")


def micro_failed(micro: MicroResult | None) -> bool:
    return micro is not None and any(f.refused or f.eos_refused for f in micro.fills)


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def part_list(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; not {', '.join(unknown) or 'none'}")
    return list(dict.fromkeys(parts))


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--parts", type=part_list, default=list(PARTS), help="validity,throughput,micro (all)")
    add("--requests", type=positive_int, default=50, help="validity: requests per server (50)")
    add("--streams", type=positive_int, default=8, help="concurrent requests: validity and throughput (8)")
    add("--rounds", type=positive_int, default=3, help="throughput: rounds of each arm (3)")
    add("--max-tokens", type=positive_int, default=160, help="max_tokens of every request (160)")
    add("--seed", type=int, default=0, help="validity: request i gets seed SEED+i (0)")
    add("--micro-repeats", type=positive_int, default=5, help="micro: compiles timed per schema (5)")
    add("--micro-passes", type=positive_int, default=3, help="micro: passes over the instances per lane (3)")
    add("--micro-sequences", type=positive_int, default=8, help="micro: sequences filled together (8; 1 always)")
    add("--no-peer", dest="peer", action="store_false", help="validity: leave out mlx_lm.server")
    add("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    add("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for {MLX_LM_F32} ({OPENBLAS_PATH})")
    add("--json", type=Path, default=None, help="also write the raw results here")
    return parser.parse_args(argv)


def load_served_model(cache_dir: Path) -> Any:
    """The embedded model exactly as `courier serve` loads it (on CPU: float32 weights)."""
    from courier.model.loader import load_model
    from courier.model.progress import Progress
    from courier.model.source import resolve_model_source

    return load_model(
        resolve_model_source(None),
        served_model_name=None,
        cache_dir=cache_dir,
        weight_format="auto",
        warmup=False,
        progress=Progress(enabled=False),
    )


def prepare(cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """Load the model in process when a part needs it: the micro-benchmarks run on it, and the peer's float32
    directory is written from it. Returns that directory (None without a peer)."""
    peer = "validity" in args.parts and args.peer
    if not peer and "micro" not in args.parts:
        return None
    progress("converting the embedded GGUF and loading it as Courier does")
    dir4 = prepare_4bit_dir(cache_dir)
    loaded = load_served_model(cache_dir)
    dir_f32 = None
    if peer:
        dir_f32 = save_float32_dir(loaded.model, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
        progress(f"float32 directory for {MLX_LM_F32}: {dir_f32}")
    if "micro" in args.parts:
        try:
            report.micro = measure_micro(loaded, args)
        except (BenchmarkError, ValueError, RuntimeError) as error:
            report.micro_error = f"{type(error).__name__}: {error}"
            progress(f"micro: FAILED: {report.micro_error}")
    del loaded
    release_mlx_memory()
    return dir_f32


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "validity" in args.parts and args.peer and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or --no-peer")
        return 2
    check_instances()
    # Before anything imports MLX, so the in-process model runs on OpenBLAS with the kernels Courier picks.
    os.environ.pop("OPENBLAS_CORETYPE", None)
    blas = load_optimized_blas()
    report = Report(environment=bench_environment(blas), settings=settings(args))
    with cache_directory(args.cache_dir) as cache_dir:
        dir_f32 = prepare(cache_dir, args, report)
        if "validity" in args.parts or "throughput" in args.parts:
            run_courier(cache_dir, args, report)
        if dir_f32 is not None:
            run_peer(dir_f32, cache_dir, args, report)
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    failed = any(run.error for run in report.servers) or report.micro_error is not None
    return 1 if failed or micro_failed(report.micro) else 0


def bench_environment(blas: BlasReport) -> dict[str, object]:
    return {
        **environment(blas),
        "llguidance": metadata.version("llguidance"),
        "jsonschema": metadata.version("jsonschema"),
    }


def settings(args: argparse.Namespace) -> dict[str, object]:
    keys: tuple[str, ...] = ("parts", "requests", "streams", "rounds", "max_tokens", "seed", "peer")
    if "micro" in args.parts:
        keys += ("micro_repeats", "micro_passes", "micro_sequences")
    return {key: getattr(args, key) for key in keys}


if __name__ == "__main__":
    sys.exit(main())
