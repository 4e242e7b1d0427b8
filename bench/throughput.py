"""Serving throughput of Courier against mlx_lm.server on the embedded SmolLM2: single-stream decode against mlx-lm
in process, then a sweep of concurrent streaming clients."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai

from bench.harness import cli
from bench.harness.clients import Burst, Streamed, async_client, burst, stream_chat, user
from bench.harness.models import WARMUP_PROMPT, launching, load_reference, prepare_4bit_dir, reference_blas
from bench.harness.report import environment, head, num, progress, ratio_text, table, verdict, write_json
from bench.harness.servers import (
    COURIER,
    COURIER_BASELINE,
    F32_KINDS,
    MLX_LM_4BIT,
    MLX_LM_F32,
    MLX_LM_F32_KERNELS,
    Server,
    ServerRecord,
    ServerSpec,
    baseline_ready,
    is_courier,
    openblas_missing,
    tree_commit,
    tuned_flags,
    wait_for_quiet,
)
from courier.platform.blas import BlasReport

SERVER_NAMES = (COURIER, COURIER_BASELINE, MLX_LM_4BIT, MLX_LM_F32, MLX_LM_F32_KERNELS)
RETRY_PAUSE_S = 5.0
TARGET_SINGLE_STREAM_RATIO = 0.95  # the targets at the comparison level (8 streams by default)
TARGET_VS_TUNED = 1.3
TARGET_VS_AS_SHIPPED = 5.0
TOPICS = (
    "the ocean", "a lighthouse", "autumn leaves", "coffee", "a mountain village", "robots",
    "the moon", "baking bread", "a thunderstorm", "chess", "honey bees", "old libraries",
    "night trains", "volcanoes", "a lost key", "jazz", "winter mornings", "deserts",
    "gardening", "comets", "bicycles", "rivers", "owls", "street markets",
)  # fmt: skip
TASKS = (
    "Write a short poem about {}.",
    "Give three fun facts about {}.",
    "Describe {} in two sentences.",
    "Tell a very short story about {}.",
    "Explain why people like {}.",
    "Write a haiku about {}.",
)
ESSAY_PROMPT = "Write a detailed, multi-paragraph essay about the history of {}."


@dataclass(frozen=True, slots=True, kw_only=True)
class Level:
    clients: int
    burst: Burst
    retried: bool = False  # the first burst was refused a connection; these are the second one's figures


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleStream:
    """Median over the single-stream prompts, each paired with mlx-lm in process on it just before."""

    decode_tps: float
    completion_tokens: list[int]
    runs_tps: list[float]
    paired_in_process_tps: float | None
    paired_runs_tps: list[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class InProcess:
    """mlx-lm `stream_generate` in this process: its own generation_tps, and the servers' decode formula."""

    weights: str
    blas: dict[str, object]
    generation_tps: float
    decode_tps: float
    completion_tokens: list[int]


@dataclass(slots=True, kw_only=True)
class Measured:
    """One server's run: its record, the load it started under, and what it measured (kept when a part fails)."""

    name: str
    server: ServerRecord | None = None
    load_at_start: float | None = None  # the 1-minute load average when its measurement started
    waited_for_quiet_s: float = 0.0
    single: SingleStream | None = None
    levels: list[Level] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    in_process: InProcess
    servers: list[Measured]


# ---------------------------------------------------------------- workload


class PromptPool:
    """Distinct short prompts, handed out in the same order for every server."""

    def __init__(self) -> None:
        self._prompts = (task.format(topic) for topic, task in itertools.product(TOPICS, TASKS))
        self._issued = 0

    def take(self, count: int) -> list[str]:
        taken = []
        for _ in range(count):
            self._issued += 1
            taken.append(next(self._prompts, None) or f"Write a short note numbered {self._issued}.")
        return taken


def essay_prompts(count: int) -> list[str]:
    """Long-answer prompts for single-stream decode, one per repeat."""
    return [ESSAY_PROMPT.format(topic) for topic in itertools.islice(itertools.cycle(TOPICS), count)]


async def stream(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> Streamed:
    streamed = await stream_chat(client, model, user(prompt), max_tokens=max_tokens, label=prompt)
    if not streamed.content_deltas:
        raise openai.OpenAIError(f"the stream for {prompt!r} carried no content")
    return streamed


async def measure(server: Server, run: Measured, prompts: Sequence[str], args: argparse.Namespace) -> None:
    """A warm-up, the single-stream prompts (each paired with mlx-lm in process just before, while the server
    idles), then each concurrency level; what is measured lands in `run` as it comes."""
    model, pool, name = server.spec.model, PromptPool(), server.spec.name
    async with async_client(server.base_url) as client:
        await stream(client, model, WARMUP_PROMPT, args.max_tokens)
        progress(f"{name}: single stream, {len(prompts)} x {args.single_tokens} tokens")
        streams, paired = [], []
        for prompt in prompts:
            paired.append(args.reference.run(prompt, args.single_tokens).generation_tps)
            streams.append(await stream(client, model, prompt, args.single_tokens))
        runs = [each.decode_tps for each in streams]
        run.single = SingleStream(
            decode_tps=statistics.median(runs),
            completion_tokens=[each.completion_tokens for each in streams],
            runs_tps=runs,
            paired_in_process_tps=statistics.median(paired),
            paired_runs_tps=paired,
        )
        for clients in args.concurrency:
            progress(f"{name}: {clients} concurrent streams x {args.max_tokens} tokens")
            try:
                pending = [stream(client, model, prompt, args.max_tokens) for prompt in pool.take(clients)]
                level = Level(clients=clients, burst=await burst(pending))
            except openai.APIConnectionError as error:
                # mlx_lm.server's HTTP server has a small listen backlog: a burst can be refused a connection.
                # Once more, after a pause, with fresh prompts (the refused ones may be partly cached by now).
                progress(f"{name}: {clients} streams: {type(error).__name__}: {error}; retrying once")
                await asyncio.sleep(RETRY_PAUSE_S)
                pending = [stream(client, model, prompt, args.max_tokens) for prompt in pool.take(clients)]
                level = Level(clients=clients, burst=await burst(pending), retried=True)
            run.levels.append(level)


def spec(name: str, dir4: Path, dir_f32: Path | None, clients: int) -> ServerSpec:
    if is_courier(name):
        return ServerSpec(name=name)
    if name == MLX_LM_4BIT:
        return ServerSpec(name=name, model_dir=dir4)
    return ServerSpec(name=name, model_dir=dir_f32, flags=tuned_flags(clients))


# ---------------------------------------------------------------- report


def level_at(runs: Sequence[Measured], name: str, clients: int) -> Burst | None:
    run = next((run for run in runs if run.name == name), None)
    return next((level.burst for level in run.levels if level.clients == clients), None) if run else None


def print_report(report: Report, args: argparse.Namespace) -> None:
    head("Courier throughput benchmark", report.environment, report.settings)
    print("### Servers\n")
    for run in report.servers:
        if run.server is not None:
            failed = f" after {len(run.levels)} levels" if run.server.error else ""
            load = f", load {run.load_at_start:.2f} at start" if run.load_at_start is not None else ""
            print(run.server.line(failed + load))
    reference = report.in_process
    print("\n### Single-stream decode\n")
    print(
        f"In-process mlx-lm `stream_generate`, {reference.weights}, BLAS {reference.blas['library']}: "
        f"generation_tps {reference.generation_tps:.1f} tok/s (same formula as HTTP: {reference.decode_tps:.1f}), "
        f"tokens {reference.completion_tokens}\n"
    )
    print("The ratio is against in-process runs of the same prompts, each just before the server's (paired).\n")
    rows = []
    for run in report.servers:
        if (one := run.single) is not None:
            paired = one.paired_in_process_tps or reference.generation_tps
            target = f" (target >= {TARGET_SINGLE_STREAM_RATIO})" if is_courier(run.name) else ""
            rows.append(
                f"{run.name} | {one.decode_tps:.1f} | {one.completion_tokens} | {paired:.1f} "
                f"| {one.decode_tps / paired:.3f}{target}"
            )
    table("server | HTTP decode tok/s | tokens | paired in-process tok/s | HTTP / in-process", rows)
    print("### Concurrency sweep\n")
    table(
        "server | clients | aggregate tok/s | TTFT p50 s | TTFT p95 s | tokens | wall s",
        (
            f"{run.name} | {level.clients}{' (retried)' if level.retried else ''} | {b.tps:.1f} | {b.ttft(0.5):.3f} "
            f"| {b.ttft(0.95):.3f} | {b.completion_tokens} | {b.wall_s:.2f}"
            for run in report.servers
            for level in run.levels
            if (b := level.burst)
        ),
    )
    print_targets(report.servers, args.compare_at)
    if COURIER_BASELINE in args.servers:
        print_baseline(report.servers, args)


def print_targets(runs: Sequence[Measured], clients: int) -> None:
    ours, tuned = level_at(runs, COURIER, clients), level_at(runs, MLX_LM_F32, clients)
    shipped, equal = level_at(runs, MLX_LM_4BIT, clients), level_at(runs, MLX_LM_F32_KERNELS, clients)

    def over(theirs: Burst | None) -> float | None:
        return ours.tps / theirs.tps if ours and theirs else None

    below = "n/a"
    if ours and tuned and shipped:
        below = "yes" if ours.ttft(0.95) < min(tuned.ttft(0.95), shipped.ttft(0.95)) else "no"
    print(f"### Targets at {clients} streams\n")
    print(f"- Courier / tuned mlx_lm.server (float32, OpenBLAS): {verdict(over(tuned), TARGET_VS_TUNED)}")
    print(f"- Courier / as-shipped mlx_lm.server (4-bit): {verdict(over(shipped), TARGET_VS_AS_SHIPPED)}")
    print(f"- Courier TTFT p95 below both: {below}")
    if (kernels := over(equal)) is not None:
        print(f"- Courier / mlx_lm.server on the same BLAS kernels: {kernels:.2f}x")


def print_baseline(runs: Sequence[Measured], args: argparse.Namespace) -> None:
    """courier / courier-baseline: single-stream decode, then aggregate tok/s and TTFT p95 at each level."""
    commit = tree_commit(args.baseline_tree)
    print("\n### courier / courier-baseline\n")
    print(
        f"`{COURIER_BASELINE}` is Courier from `{args.baseline_tree}`{f' (commit {commit})' if commit else ''}, run "
        f"and measured like `{COURIER}`. Above 1 favours courier for tok/s, below 1 for TTFT.\n"
    )
    singles = {run.name: run.single for run in runs}
    ours, theirs = singles.get(COURIER), singles.get(COURIER_BASELINE)
    if ours and theirs:
        single = ratio_text(ours.decode_tps, theirs.decode_tps, num)
        print(f"- courier / courier-baseline, single-stream decode tok/s: {single}")
    levels = [(n, level_at(runs, COURIER, n), level_at(runs, COURIER_BASELINE, n)) for n in args.concurrency]
    for clients, level, base in levels:
        if level is not None and base is not None:
            tps = ratio_text(level.tps, base.tps, num)
            ttft = ratio_text(level.ttft(0.95), base.ttft(0.95), lambda value: num(value, 3))
            print(f"- courier / courier-baseline at {clients} streams: aggregate tok/s {tps}, TTFT p95 s {ttft}")
    if not any(level and base for _, level, base in levels):
        print("- courier / courier-baseline: no ratio (one of them measured no level)")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--concurrency", type=cli.positive_ints, default=[1, 4, 8, 16], help="client counts (1,4,8,16)")
    add("--max-tokens", type=int, default=32, help="completion tokens per sweep request (32)")
    add("--servers", type=cli.names(SERVER_NAMES), default=None, help=f"{','.join(SERVER_NAMES)} (all but baseline)")
    add("--single-tokens", type=int, default=128, help="max tokens per single-stream request (128)")
    add("--single-repeats", type=int, default=3, help="single-stream requests per server (3)")
    add("--compare-at", type=int, default=8, help="client count the targets are checked at (8)")
    add("--quiet-load", type=float, default=None, help="wait for a 1-minute load below this")
    add("--quiet-timeout", type=float, default=900.0, help="longest wait for a quiet machine (900 s)")
    cli.add_results(parser, openblas=MLX_LM_F32)
    cli.add_baseline(parser)
    cli.add_weights(parser)
    args = parser.parse_args(argv)
    default = [name for name in SERVER_NAMES if name != COURIER_BASELINE]
    args.servers = cli.choose_servers(parser, "--servers", args.servers, default, args.baseline_tree)
    return args


def prepare_reference(cache_dir: Path, prompts: Sequence[str], args: argparse.Namespace, blas: BlasReport) -> InProcess:
    """Convert the GGUF, write the float32 directory if a peer needs it, and measure mlx-lm in process (kept
    loaded in `args.reference`, so each server's single-stream runs are paired with in-process runs)."""
    progress("converting the embedded GGUF to a 4-bit MLX directory")
    args.dir4 = prepare_4bit_dir(cache_dir)
    f32 = any(server in args.servers for server in F32_KINDS)
    args.reference, weights, args.dir_f32 = load_reference(args.dir4, args.weights, cache_dir, float32_needed=f32)
    progress(f"in-process mlx-lm: {len(prompts)} x {args.single_tokens} tokens")
    runs = [args.reference.run(prompt, args.single_tokens) for prompt in prompts]
    return InProcess(
        weights=weights,
        blas=blas.as_dict(),
        generation_tps=statistics.median(run.generation_tps for run in runs),
        decode_tps=statistics.median(run.decode_tps for run in runs),
        completion_tokens=[run.completion_tokens for run in runs],
    )


def report_runs(args: argparse.Namespace, blas: BlasReport, in_process: InProcess, runs: list[Measured]) -> None:
    """The tables on stdout and the JSON, of every server measured so far."""
    settings = {
        **{key: getattr(args, key) for key in ("concurrency", "max_tokens", "single_tokens", "single_repeats")},
        **{"servers": args.servers, "quiet_load": args.quiet_load},
        **{"baseline_tree": str(args.baseline_tree) if args.baseline_tree else None, "weights": in_process.weights},
        **{"openblas_kernels": blas.kernels, "openblas_kernel_choice": blas.kernel_choice},
    }
    report = Report(environment=environment(blas), settings=settings, in_process=in_process, servers=runs)
    print_report(report, args)
    write_json(report, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    f32 = any(server in args.servers for server in F32_KINDS)
    if openblas_missing(args.openblas, f32, f"leave out {MLX_LM_F32}"):
        return 2
    if not baseline_ready(args.baseline_tree, args.servers):
        return 2
    blas = reference_blas()
    prompts = essay_prompts(args.single_repeats)
    runs: list[Measured] = []
    in_process: InProcess | None = None
    options = {"openblas": args.openblas, "kernels": blas.kernels, "baseline_tree": args.baseline_tree}
    try:
        with launching("throughput", args.cache_dir, **options) as launcher:
            wait_for_quiet(args.quiet_load, args.quiet_timeout)
            in_process = prepare_reference(launcher.cache_dir, prompts, args, blas)
            for name in args.servers:
                load, waited = wait_for_quiet(args.quiet_load, args.quiet_timeout)
                run = Measured(name=name, load_at_start=load, waited_for_quiet_s=waited)
                runs.append(run)

                def measured(server: Server, run: Measured = run) -> None:
                    asyncio.run(measure(server, run, prompts, args))

                run.server, _ = launcher.run(spec(name, args.dir4, args.dir_f32, max(args.concurrency)), measured)
    finally:  # also when stopped (a time limit's SIGINT): what was measured is reported
        if in_process is not None:
            report_runs(args, blas, in_process, runs)
    return 1 if any(run.server is None or run.server.error for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
