"""Multi-token decode steps (prompt-lookup drafts verified in one forward pass, and tokens a grammar forces) on the
embedded SmolLM2, side by side with Courier without them and with mlx-lm, on four greedy workloads."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import cli, clients, models, servers
from bench.harness.clients import Round, Streamed, async_client, burst, json_schema_format, pooled_tps, stream_chat
from bench.harness.report import environment, head, inline, num, percent, progress, shown, table, verdict, write_json
from bench.harness.servers import COURIER, MLX_LM_F32_KERNELS, RUN_ERRORS, Server, ServerRecord, ServerSpec
from bench.harness.stats import finite_median, ratio
from bench.speculative_workloads import SINGLE_WORKLOADS, WORKLOADS, Request, requests_for, verbatim_share
from bench.structured_schemas import check_reply

PARTS = ("single", "aggregate", "chat", "json")
NO_SPEC = "courier-no-spec"
PEER = MLX_LM_F32_KERNELS
IN_PROCESS = "mlx-lm in process"
TARGET_SINGLE_VS_MLX_LM = 1.8  # on (a) and (b)
TARGET_AGGREGATE_VS_NO_SPEC = 1.3
TARGET_CHAT_VS_NO_SPEC = 0.97
TARGET_CONSTRAINED_VS_FREE = 1.0
# A server is idle once its CPU time grows by less than this share of one core over SETTLE_WINDOW_S.
SETTLE_WINDOW_S = 0.5
SETTLE_SHARE = 0.05
SETTLE_LIMIT_S = 20.0
SPECULATIVE_PREFIX = "courier_speculative_"

# ---------------------------------------------------------------- measuring


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """Courier's `courier_speculative_*` counters (names as exported, `_total` included), or their growth."""

    values: dict[str, float] = field(default_factory=dict)

    def since(self, before: Counters) -> Counters:
        return Counters(values={name: value - before.values.get(name, 0.0) for name, value in self.values.items()})

    def get(self, name: str) -> float | None:
        return self.values.get(f"{SPECULATIVE_PREFIX}{name}_total")

    @property
    def acceptance(self) -> float | None:
        return ratio(self.get("accepted_tokens"), self.get("drafted_tokens"))

    @property
    def tokens_per_pass(self) -> float | None:
        return ratio(self.get("emitted_tokens"), self.get("steps"))


def summed(counters: Sequence[Counters]) -> Counters:
    names = {name for each in counters for name in each.values}
    return Counters(values={name: sum(each.values.get(name, 0.0) for each in counters) for name in names})


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A started server with its clients: the `openai` one, and plain HTTP for /metrics."""

    server: Server
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient

    async def counters(self) -> Counters:
        """Its speculative counters now; none when it is not Courier or does not export them."""
        if not self.server.spec.is_courier:
            return Counters()
        try:
            response = await self.http.get("/metrics", timeout=30.0)
        except httpx.HTTPError:
            return Counters()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text if response.status_code == 200 else ""):
            for sample in family.samples:
                if sample.name.startswith(SPECULATIVE_PREFIX) and sample.name.endswith("_total"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return Counters(values=values)

    async def ask(self, request: Request, max_tokens: int, *, constrained: bool = False) -> Streamed:
        """One streamed chat completion at temperature 0; a constrained one carries the request's json_schema."""
        schema = json_schema_format(request.schema_name, request.schema) if constrained and request.schema else None
        model, messages = self.server.spec.model, clients.user(request.prompt)
        extra: dict[str, Any] = {"label": request.label, "response_format": schema or openai.omit}
        return await stream_chat(self.client, model, messages, max_tokens=max_tokens, **extra)


async def settle(links: Sequence[Link]) -> None:
    """Wait until every server process is idle (CPU time flat for SETTLE_WINDOW_S, at most SETTLE_LIMIT_S)."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_LIMIT_S:
        before = [link.server.cpu_seconds() for link in links]
        await asyncio.sleep(SETTLE_WINDOW_S)
        grown = max(link.server.cpu_seconds() - cpu for link, cpu in zip(links, before, strict=True))
        if grown < SETTLE_SHARE * SETTLE_WINDOW_S:
            return


@dataclass(frozen=True, slots=True, kw_only=True)
class InProcessRun:
    """mlx-lm's `stream_generate` in this process: the HTTP formula's decode rate, and mlx-lm's own figure."""

    workload: str
    label: str
    decode_tps: float
    generation_tps: float
    completion_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleRun:
    server: str
    workload: str
    reply: Streamed
    counters: Counters


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRound:
    """One arm's requests sent together (`round.valid_json` for a constrained arm), and the counters' growth."""

    round: Round
    counters: Counters


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Two arms (`arms[0]` / `arms[1]`) over the same requests, rounds alternating."""

    part: str
    streams: int
    arms: tuple[str, str]
    target: float
    rounds: list[MeasuredRound] = field(default_factory=list)

    def pooled_tps(self, arm: str) -> float:
        return pooled_tps([measured.round for measured in self.rounds], arm)

    @property
    def ratio(self) -> float:
        theirs = self.pooled_tps(self.arms[1])
        return self.pooled_tps(self.arms[0]) / theirs if theirs else math.nan

    def counters(self, arm: str) -> Counters:
        return summed([measured.counters for measured in self.rounds if measured.round.arm == arm])


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    servers: list[ServerRecord] = field(default_factory=list)
    in_process: list[InProcessRun] = field(default_factory=list)
    single: list[SingleRun] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # parts that stopped on a failed request
    load_at_parts: dict[str, float | None] = field(default_factory=dict)


def cap(args: argparse.Namespace, key: str) -> int:
    """max_tokens for a workload's requests: `--max-tokens` when given, else the workload's own."""
    return int(args.max_tokens or WORKLOADS[key].max_tokens)


# ---------------------------------------------------------------- parts


def measure_in_process(dir4: Path, cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """mlx-lm's `stream_generate` on the single part's requests, on the weights `--weights` names; writes the
    float32 directory mlx_lm.server serves when it runs (returned)."""
    reference, _, dir_f32 = models.load_reference(dir4, args.weights, cache_dir, float32_needed=args.peer)
    for repeat in range(args.repeats):
        for key in args.workloads:
            request = requests_for(key, 1, repeat)[0]
            run = reference.run(request.prompt, cap(args, key))
            figures = {"decode_tps": run.decode_tps, "generation_tps": run.generation_tps}
            tokens = run.completion_tokens
            report.in_process.append(
                InProcessRun(workload=key, label=request.label, completion_tokens=tokens, **figures)
            )
            progress(f"single, {IN_PROCESS}, {request.label}: {tokens} tokens, {run.decode_tps:.1f} tok/s")
    return dir_f32


async def part_single(links: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """Each request to each server in turn, the first server rotating, every server idle before each."""
    names = [name for name in (COURIER, NO_SPEC, PEER) if name in links]
    for repeat in range(args.repeats):
        for position, key in enumerate(args.workloads):
            request = requests_for(key, 1, repeat)[0]
            shift = (repeat * len(args.workloads) + position) % len(names)
            for name in names[shift:] + names[:shift]:
                await settle(list(links.values()))
                before = await links[name].counters()
                reply = await links[name].ask(request, cap(args, key))
                counters = (await links[name].counters()).since(before)
                report.single.append(SingleRun(server=name, workload=key, reply=reply, counters=counters))
                progress(
                    f"single, {name}, {request.label}: {reply.completion_tokens} tokens, {reply.decode_tps:.1f} "
                    f"tok/s, TTFT {reply.ttft_s:.2f} s"
                )


COMPARED_PARTS: dict[str, tuple[str, float]] = {  # part: its workload and the target of its ratio
    "aggregate": ("a", TARGET_AGGREGATE_VS_NO_SPEC),
    "chat": ("c", TARGET_CHAT_VS_NO_SPEC),
    "json": ("d", TARGET_CONSTRAINED_VS_FREE),
}
PART_SERVERS = {"single": (COURIER, NO_SPEC), "aggregate": (COURIER, NO_SPEC), "chat": (COURIER, NO_SPEC)}


async def part_compared(part: str, links: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """Two arms over the same requests, `--rounds` rounds, the arms' order reversed every round, every distinct
    prompt first sent once to each arm with max_tokens 1 (docs/benchmarks.md)."""
    key, target = COMPARED_PARTS[part]
    if part == "json":
        arms = (("constrained", links[COURIER], True), ("free", links[COURIER], False))
    else:
        arms = ((COURIER, links[COURIER], False), (NO_SPEC, links[NO_SPEC], False))
    for streams in [args.streams] if part == "aggregate" else sorted({1, args.streams}):
        # Round r takes the requests after round r-1's: at 1 stream each round has another prompt; at 8 the
        # workload's prompts come round again (8 changes, 8 stories, 4 extraction cases).
        rounds = [requests_for(key, streams, index * streams) for index in range(args.rounds)]
        comparison = Comparison(part=part, streams=streams, arms=(arms[0][0], arms[1][0]), target=target)
        report.comparisons.append(comparison)  # kept with the rounds it has when a later one fails
        distinct = list({request.prompt: request for requests in rounds for request in requests}.values())
        for _, link, constrained in arms:
            await asyncio.gather(*(link.ask(request, 1, constrained=constrained) for request in distinct))
        for index, requests in enumerate(rounds, start=1):
            for arm, link, constrained in arms if index % 2 else arms[::-1]:
                await settle(list(links.values()))
                before = await link.counters()
                done = await burst([link.ask(request, cap(args, key), constrained=constrained) for request in requests])
                counters = (await link.counters()).since(before)
                valid = None
                if constrained:
                    pairs = zip(done.streams, requests, strict=True)
                    valid = sum(check_reply(s.text, r.schema)[1] for s, r in pairs if r.schema)
                measured = Round(arm=arm, index=index, burst=done, valid_json=valid)
                comparison.rounds.append(MeasuredRound(round=measured, counters=counters))
                progress(
                    f"{part}, {streams} stream(s), round {index}, {arm}: {done.completion_tokens} tokens in "
                    f"{done.wall_s:.2f} s = {done.tps:.1f} tok/s"
                )


async def run_parts(live: dict[str, Server], args: argparse.Namespace, report: Report) -> None:
    """Warm each server up, then the parts in order; a part whose request fails is recorded and the next goes on."""
    links = {
        name: Link(
            server=server, client=async_client(server.base_url), http=httpx.AsyncClient(base_url=server.base_url)
        )
        for name, server in live.items()
    }
    try:
        for name, link in links.items():
            try:
                await link.ask(Request(label="warm-up", prompt=models.WARMUP_PROMPT), 8)
            except RUN_ERRORS as error:
                report.errors.append(f"{name}: warm-up failed: {type(error).__name__}: {error}")
        for part in args.parts:
            if missing := [name for name in PART_SERVERS.get(part, (COURIER,)) if name not in links]:
                report.errors.append(f"{part}: not run, {', '.join(missing)} did not start")
                continue
            report.load_at_parts[part] = servers.load_average()
            progress(f"part {part} (load {report.load_at_parts[part]})")
            try:
                await (
                    part_single(links, args, report) if part == "single" else part_compared(part, links, args, report)
                )
            except RUN_ERRORS as error:
                report.errors.append(f"{part}: {type(error).__name__}: {error}")
                progress(f"{part}: FAILED: {report.errors[-1]}")
    finally:
        for link in links.values():
            await link.client.close()
            await link.http.aclose()


# ---------------------------------------------------------------- report


def single_rows(report: Report, key: str) -> list[tuple[str, list[float], list[int], list[SingleRun]]]:
    """Per server (mlx-lm in process first): decode rates, completion tokens, and the HTTP runs."""
    rows: list[tuple[str, list[float], list[int], list[SingleRun]]] = []
    if own := [run for run in report.in_process if run.workload == key]:
        rows.append((IN_PROCESS, [run.decode_tps for run in own], [run.completion_tokens for run in own], []))
    for name in (COURIER, NO_SPEC, PEER):
        if runs := [run for run in report.single if run.server == name and run.workload == key]:
            replies = [run.reply for run in runs]
            rows.append((name, [r.decode_tps for r in replies], [r.completion_tokens for r in replies], runs))
    return rows


def measured_workloads(report: Report) -> list[str]:
    measured = {run.workload for run in report.in_process} | {run.workload for run in report.single}
    return [key for key in SINGLE_WORKLOADS if key in measured]


def median_tps(report: Report, name: str, key: str) -> float | None:
    return next((finite_median(rates) for row, rates, _, _ in single_rows(report, key) if row == name), None)


def identical(report: Report, key: str) -> str:
    """Whether Courier with and without speculation returned the same text for every request of a workload."""
    texts = {(run.server, run.reply.label): run.reply.text for run in report.single if run.workload == key}
    ours = {label: text for (name, label), text in texts.items() if name == COURIER}
    pairs = [(text, texts[NO_SPEC, label]) for label, text in ours.items() if (NO_SPEC, label) in texts]
    if not pairs:
        return "n/a"
    same = sum(a == b for a, b in pairs)
    return f"{'yes' if same == len(pairs) else 'NO'} ({same}/{len(pairs)})"


def print_single(report: Report) -> None:
    print(f"### Single stream: {', '.join(f'({key}) {WORKLOADS[key].title}' for key in measured_workloads(report))}\n")
    print(
        "Decode tok/s = (completion tokens - 1) / (last - first content chunk), median over the requests. "
        "Acceptance and tokens per forward pass from Courier's /metrics around each request.\n"
    )
    rows = []
    for key in measured_workloads(report):
        for name, rates, tokens, runs in single_rows(report, key):
            counters = summed([run.counters for run in runs])
            prompt_tokens = sorted({run.reply.prompt_tokens for run in runs if run.reply.prompt_tokens is not None})
            verbatim = [v for run in runs if (v := verbatim_share(run.reply.text, WORKLOADS[key].source)) is not None]
            courier = bool(runs) and name != PEER
            rows.append(
                f"({key}) {WORKLOADS[key].title} | {name} | {num(finite_median(rates))} "
                f"| {', '.join(num(rate) for rate in rates)} | {tokens} | {prompt_tokens or '-'} "
                f"| {num(finite_median([run.reply.ttft_s for run in runs]), 2) if runs else '-'} "
                f"| {percent(statistics.fmean(verbatim), 0) if verbatim else '-'} "
                f"| {percent(counters.acceptance, 0) if courier else '-'} "
                f"| {num(counters.tokens_per_pass, 2) if courier else '-'}"
            )
    table(
        "workload | server | decode tok/s | per request | completion tokens | prompt tokens | TTFT s | verbatim lines "
        "| acceptance | tokens per pass",
        rows,
    )
    rows = []
    for key in measured_workloads(report):
        ours = median_tps(report, COURIER, key)
        ratios = [num(ratio(ours, median_tps(report, name, key)), 2) for name in (IN_PROCESS, PEER, NO_SPEC)]
        rows.append(f"({key}) {WORKLOADS[key].title} | {num(ours)} | {' | '.join(ratios)} | {identical(report, key)}")
    table(
        "workload | Courier tok/s | / mlx-lm in process | / mlx_lm.server | / Courier without speculation "
        "| identical text with and without",
        rows,
    )
    for key in ("a", "b"):
        ours = median_tps(report, COURIER, key)
        for name, label in ((IN_PROCESS, "mlx-lm `stream_generate` in process"), (PEER, "mlx_lm.server")):
            if (value := ratio(ours, median_tps(report, name, key))) is not None:
                print(f"- ({key}) Courier / {label}: {verdict(value, TARGET_SINGLE_VS_MLX_LM)}")
    for key in measured_workloads(report):
        if sample := next((run.reply for run in report.single if run.server == COURIER and run.workload == key), None):
            print(f"- a Courier reply, {sample.label} ({sample.finish_reason}): {inline(shown(sample.text))}")
    print()


COMPARISON_TITLES = {
    "aggregate": "(a) code edit, Courier against Courier without speculation",
    "chat": "(c) free chat, Courier against Courier without speculation",
    "json": "(d) json extraction on Courier, constrained (json_schema) against free text",
}


def round_row(measured: MeasuredRound) -> str:
    """A round's cells, its decode tok/s (median over its streams) and TTFT p50, then from /metrics acceptance,
    tokens per pass, verify steps / steps and forced tokens per request."""
    done, counters, valid = measured.round.burst, measured.counters, measured.round.valid_json
    steps, verify, forced = counters.get("steps"), counters.get("verify_steps"), counters.get("forced_tokens")
    steps_text = f"{verify:.0f} / {steps:.0f}" if steps is not None and verify is not None else "n/a"
    forced_text = num(forced / len(done.streams), 1) if forced is not None else "n/a"
    return (
        f"{measured.round.cells()} | {num(finite_median([s.decode_tps for s in done.streams]))} | {done.ttft(0.5):.2f} "
        f"| {percent(counters.acceptance, 0)} | {num(counters.tokens_per_pass, 2)} | {steps_text} | {forced_text} "
        f"| {f'{valid}/{len(done.streams)}' if valid is not None else '-'}"
    )


def print_comparison(comparison: Comparison, *, explain: bool) -> None:
    print(f"### {COMPARISON_TITLES[comparison.part]}, {comparison.streams} stream(s)\n")
    if explain:
        print(
            "A round's tok/s = its completion tokens / (first request sent .. last stream done); decode tok/s is the "
            "median over its streams. Counters from Courier's /metrics around the round (tokens per forward pass "
            "counts all sequences of the batch).\n"
        )
    table(
        "round | arm | tokens | tokens per stream | capped | wall s | tok/s | decode tok/s | TTFT p50 s "
        "| acceptance | tokens per pass | verify steps / steps | forced per request | valid JSON",
        (round_row(measured) for measured in comparison.rounds),
    )
    for arm in comparison.arms:
        counters = comparison.counters(arm)
        print(
            f"- {arm}: pooled {num(comparison.pooled_tps(arm))} tok/s; acceptance {percent(counters.acceptance, 0)}, "
            f"tokens per forward pass {num(counters.tokens_per_pass, 2)}"
        )
    print(f"- {comparison.arms[0]} / {comparison.arms[1]}: {verdict(comparison.ratio, comparison.target)}")
    for arm in comparison.arms:
        if sample := next((m.round.burst.streams[0] for m in comparison.rounds if m.round.arm == arm), None):
            print(f"- a reply of {arm}, {sample.completion_tokens} tokens: {inline(shown(sample.text))}")
    print()


def print_report(report: Report) -> None:
    head("Courier speculative decoding benchmark", report.environment, report.settings)
    print(f"- 1-minute load average at the start of each part: {report.load_at_parts}\n")
    print("### Servers\n")
    print("\n".join(record.line() for record in report.servers) + "\n")
    if report.in_process or report.single:
        print_single(report)
    for index, comparison in enumerate(report.comparisons):
        print_comparison(comparison, explain=index == 0)
    for error in report.errors:
        print(f"- FAILED: {error}")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(PARTS), help=f"{','.join(PARTS)} (all)")
    add("--repeats", type=cli.positive_int, default=2, help="single: requests per workload and server (2)")
    add("--streams", type=cli.positive_int, default=8, help="aggregate, chat, json: concurrent streams (8)")
    add("--rounds", type=cli.positive_int, default=2, help="aggregate, chat, json: rounds of each arm (2)")
    add("--max-tokens", type=cli.positive_int, default=None, help="max_tokens of every request (default: per workload)")
    add("--no-peer", dest="peer", action="store_false", help=f"single: leave out mlx_lm.server ({PEER})")
    singles = cli.names(SINGLE_WORKLOADS, in_given_order=False)
    add("--workloads", type=singles, default=list(SINGLE_WORKLOADS), help="single: among a,b,c (all)")
    cli.add_results(parser, openblas=PEER)
    cli.add_weights(parser)
    args = parser.parse_args(argv)
    args.peer = args.peer and "single" in args.parts
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if servers.openblas_missing(args.openblas, args.peer, "--no-peer"):
        return 2
    blas = models.reference_blas()
    keys = ("parts", "workloads", "repeats", "streams", "rounds", "max_tokens", "peer", "weights")
    settings = {key: getattr(args, key) for key in keys}
    settings |= {"max_tokens_by_workload": {key: cap(args, key) for key in WORKLOADS}, "kernels": blas.kernels}
    report = Report(environment=environment(blas), settings=settings)
    options = {"openblas": args.openblas, "kernels": blas.kernels}
    with models.launching("speculative", args.cache_dir, **options) as launcher:
        dir_f32 = None
        if "single" in args.parts:  # mlx-lm in process before any server starts, its memory released afterwards
            progress("converting the embedded GGUF to a 4-bit MLX directory")
            dir_f32 = measure_in_process(models.prepare_4bit_dir(launcher.cache_dir), launcher.cache_dir, args, report)
            models.release_mlx_memory()
        specs = [ServerSpec(name=COURIER)]
        if {"single", "aggregate", "chat"} & set(args.parts):
            specs.append(ServerSpec(name=NO_SPEC, kind=COURIER, flags=("--no-speculation",)))
        if args.peer:
            specs.append(ServerSpec(name=PEER, model_dir=dir_f32, flags=servers.tuned_flags(args.streams)))
        with ExitStack() as stack:  # the servers start one after another and stay up until the last part
            asyncio.run(run_parts(servers.start_all(launcher, specs, stack), args, report))
        report.servers = launcher.records
    print_report(report)
    write_json(report, args.json)
    return 1 if report.errors or any(record.error for record in report.servers) else 0


if __name__ == "__main__":
    sys.exit(main())
