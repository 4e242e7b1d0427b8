"""Structured outputs (constrained decoding) on the embedded SmolLM2: validity beside mlx_lm.server, the cost of a
grammar against free text, and the grammar's own work in process."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from bench.harness import cli, models, servers
from bench.harness.clients import Round, async_client, burst, json_schema_format, pooled_tps, stream_chat, user
from bench.harness.report import environment, head, inline, percent, progress, shown, table, write_json
from bench.harness.servers import COURIER, MLX_LM_F32, BenchmarkError, Server, ServerRecord, ServerSpec
from bench.structured_micro import Micro, measure_micro, print_micro
from bench.structured_schemas import SCHEMAS, check_reply, essay_prompts, essay_schema, validity_prompt

PARTS = ("validity", "throughput", "micro")
TARGET_VALID_AMONG_FINISHED = 1.0
TARGET_THROUGHPUT_RATIO = 0.90
FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
VALIDITY_TEMPERATURE = 1.0
THROUGHPUT_TEMPERATURE = 0.0
LOG_PROBLEM = re.compile(r" (WARNING|ERROR|CRITICAL) |Traceback")
LOG_PROBLEMS_SHOWN = 5


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
    blas = models.reference_blas()
    keys = ["parts", "requests", "streams", "rounds", "max_tokens", "seed", "peer"]
    keys += ["micro_repeats", "micro_passes", "micro_sequences"] if "micro" in args.parts else []
    settings = {key: getattr(args, key) for key in keys}
    report = Report(environment=environment(blas, "llguidance", "jsonschema"), settings=settings)
    with models.launching("structured", args.cache_dir, openblas=args.openblas) as launcher:
        dir_f32 = prepare(launcher.cache_dir, args, report)

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
