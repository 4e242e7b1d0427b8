"""Multi-turn prompt caching of Courier against mlx_lm.server: (a) one long conversation on SmolLM2, (b) K
conversations interleaved on tiny models, at defaults and at an equal byte budget, (c) the snapshot store's latency
in process, (d) the disk tier: many conversations, a restart, and a disk hit's TTFT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import cli, models
from bench.harness.clients import Messages, async_client
from bench.harness.conversations import Turn, ask, cached_share, check_deadline, later, ttft_p50
from bench.harness.models import TINY_MODELS, WIDE_TINY_MODELS, float32_dir
from bench.harness.report import environment, head, ms, percent, progress, table, write_json
from bench.harness.servers import (
    COURIER,
    COURIER_BASELINE,
    MLX_LM_4BIT,
    MLX_LM_F32,
    Launcher,
    Server,
    ServerRecord,
    baseline_ready,
    openblas_missing,
)
from bench.multiturn_disk import Restart, print_part_d, run_part_d
from bench.multiturn_disk_ttft import DiskTtft, print_part_d3, run_part_d3
from bench.multiturn_interleaved import (
    B_BUDGETS,
    B_SERVERS,
    BUDGET_STATES,
    DEFAULT_MAX_TOKENS_B,
    DEFAULT_SYSTEM_TOKENS_B,
    EQUAL_CONVERSATIONS,
    QUANTIZED_COURIERS,
    REQUEST_TIMEOUT_S,
    SYSTEM_PROMPT_A,
    USER_MESSAGES_A,
    ByteBudget,
    Run,
    baseline_line,
    handbook_words,
    is_courier,
    print_launches,
    print_part_b,
    run_part_b,
    spec,
    system_prompt_b,
    user_message_b,
    warm_up,
    with_stats,
)
from bench.multiturn_store import measure_store, print_part_c
from courier.platform.blas import load_optimized_blas

__all__ = ["handbook_words", "main", "parse_args", "system_prompt_b", "user_message_b"]  # bench.cluster uses three

PARTS = ("a", "b", "c", "d")
DEFAULT_PARTS = ("a", "b", "c")  # part d only when asked for: it starts 23 servers and takes about 27 minutes
A_SERVERS = (COURIER, MLX_LM_F32, MLX_LM_4BIT)

# Part d: the disk tier.
D_SECTIONS = ("1", "2", "3")
D_SERVERS = (COURIER, MLX_LM_F32, *QUANTIZED_COURIERS)
D_DEFAULT_SERVERS = (COURIER, MLX_LM_F32)
D_CONVERSATIONS = [8, 32, 128]
D_TURNS = 4
D_BUDGET_CONVERSATIONS = 8  # the memory budget holds this many conversations (model states at their last prompt)
D_DISK_BYTES = 2 << 30  # room for every conversation of the largest K many times over
D_RESTART_CONVERSATIONS = 32
D_STOP_SIGNALS = {"term": signal.SIGTERM, "kill": signal.SIGKILL}
D_TTFT_REPEATS = 5
D_HISTORY_TOKENS = 2000
D_TTFT_MAX_TOKENS = 8


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    conversation: list[Run] = field(default_factory=list)
    interleaved: list[Run] = field(default_factory=list)
    budgets: list[ByteBudget] = field(default_factory=list)
    store: dict[str, Any] | None = None
    disk_budgets: list[ByteBudget] = field(default_factory=list)
    disk_runs: list[Run] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    ttft: list[DiskTtft] = field(default_factory=list)
    wall_s: dict[str, float] = field(default_factory=dict)  # part d, per section

    def records(self) -> list[ServerRecord]:
        records = [run.server for run in self.conversation + self.interleaved + self.disk_runs]
        for restart in self.restarts:
            records += [restart.before] + ([restart.after] if restart.after else [])
        return records + [record for item in self.ttft for record in (item.probe, item.server) if record]


# ---------------------------------------------------------------- part a: one long conversation


async def converse(server: Server, args: argparse.Namespace) -> list[Turn]:
    deadline = time.monotonic() + args.run_timeout
    turns: list[Turn] = []
    async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, server.spec.model)
        messages: Messages = [{"role": "system", "content": SYSTEM_PROMPT_A}]
        for index in range(args.turns):
            check_deadline(deadline, f"{server.spec.name} conversation")
            base = USER_MESSAGES_A[index % len(USER_MESSAGES_A)]
            text = base if index < len(USER_MESSAGES_A) else f"{base} (question {index + 1})"
            messages.append({"role": "user", "content": text})
            turns.append(await ask(client, server.spec.model, messages, args.a_max_tokens, at=(1, index + 1)))
            messages.append({"role": "assistant", "content": turns[-1].reply.text})
    return turns


def run_part_a(launcher: Launcher, dir4: Path, args: argparse.Namespace, report: Report) -> None:
    dir_f32 = None
    if MLX_LM_F32 in args.a_servers:
        progress("dequantizing the 4-bit SmolLM2 directory to float32 for mlx-lm-f32")
        dir_f32 = float32_dir(dir4, launcher.cache_dir)
    for label in args.a_servers:
        if is_courier(label):
            chosen = spec(label, None, *args.courier_arg)
        else:
            chosen = spec(MLX_LM_F32, dir_f32, "--log-level", "WARNING") if label == MLX_LM_F32 else spec(label, dir4)

        def measure(server: Server) -> tuple[list[Turn], dict[str, Any] | None]:
            return with_stats(server, asyncio.run(converse(server, args)))

        record, result = launcher.run(chosen, measure, log_name=f"a-{label}")
        turns, stats = result or ([], None)
        report.conversation.append(Run(server=record, turns=turns, stats=stats))


def print_part_a(runs: Sequence[Run]) -> None:
    print("### (a) One conversation, ~300-token system prompt, SmolLM2-135M-Instruct\n")
    print_launches([run.server for run in runs])

    def cells(run: Run, number: int) -> str:
        turn = next((item for item in run.turns if item.turn == number), None)
        return " |  | " if turn is None else f"{ms(turn.reply.ttft_s)} | {turn.prompt_tokens} | {turn.cached_tokens}"

    count = max(len(r.turns) for r in runs)
    rows = [f"{n} | " + " | ".join(cells(run, n) for run in runs) for n in range(1, 1 + count)]
    summary = (f"{ms(ttft_p50(later(r.turns)))} | | {percent(cached_share(r.turns))}" for r in runs)
    rows.append("p50 / share, turns 2+ | " + " | ".join(summary))
    table("turn | " + " | ".join(f"{run.server.name} TTFT ms | prompt | cached" for run in runs), rows)
    named = {run.server.name: run for run in runs}
    if COURIER in named and COURIER_BASELINE in named:
        print(baseline_line("", named[COURIER].turns, named[COURIER_BASELINE].turns))
    keys = ("snapshot_entries", "snapshot_hits", "snapshot_lookups", "snapshot_supersedes", "tokens_reused")
    for run in runs:
        if run.stats is not None:
            print(f"- {run.server.name} cache stats: " + ", ".join(f"{key} {run.stats.get(key)}" for key in keys))
    print()


def print_report(report: Report, args: argparse.Namespace) -> None:
    head("Courier multi-turn benchmark", report.environment, report.settings, device=False)
    if report.conversation:
        print_part_a(report.conversation)
    if report.interleaved:
        print_part_b(report.interleaved, report.budgets, args)
    if report.store is not None:
        print_part_c(report.store)
    if "d" in args.parts:
        print_part_d(report, args)
    if report.ttft:
        print_part_d3(report)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(DEFAULT_PARTS), help="parts to run (a,b,c; d when asked for)")
    add("--run-timeout", type=float, default=900.0, help="seconds of measuring one server run may take (900)")
    add("--courier-arg", action="append", default=[], help="a flag for every Courier, as --courier-arg=--flag=value")
    tiny = cli.names((*TINY_MODELS, *WIDE_TINY_MODELS))
    add = parser.add_argument_group("part a: one conversation on SmolLM2").add_argument
    add("--turns", type=int, default=10, help="turns of the conversation (10)")
    add("--a-max-tokens", type=int, default=24, help="max_tokens per turn (24)")
    add("--a-servers", type=cli.names((*A_SERVERS, COURIER_BASELINE)), default=None, help=f"{','.join(A_SERVERS)}")
    add = parser.add_argument_group("part b: K interleaved conversations on tiny models").add_argument
    add("--conversations", type=cli.positive_ints, default=[2, 8, 32], help="K values (2,8,32)")
    add("--b-turns", type=int, default=4, help="turns per conversation (4)")
    add("--b-max-tokens", type=int, default=DEFAULT_MAX_TOKENS_B, help=f"max_tokens per turn ({DEFAULT_MAX_TOKENS_B})")
    wide = "-wide: 64-dimension heads, for courier-8bit and courier-4bit"
    add("--b-models", type=tiny, default=list(TINY_MODELS), help=f"llama,qwen3_next ({wide})")
    add("--b-servers", type=cli.names(B_SERVERS), default=None, help=f"{','.join(B_SERVERS)}")
    add("--b-system-tokens", type=int, default=DEFAULT_SYSTEM_TOKENS_B, help="tokens of each system prompt (550)")
    add("--b-budgets", type=cli.names(B_BUDGETS), default=list(B_BUDGETS), help=f"{','.join(B_BUDGETS)}")
    add(
        "--equal-conversations",
        type=cli.positive_ints,
        default=EQUAL_CONVERSATIONS,
        help="K, equal budget (4-16,20,24)",
    )
    add("--budget-states", type=int, default=BUDGET_STATES, help=f"equal budget in model states ({BUDGET_STATES})")
    add("--budget-bytes", type=int, default=None, help="the equal byte budget itself (default: derived)")
    add = parser.add_argument_group("part c: the snapshot store in process").add_argument
    add("--store-entries", type=int, default=10_000, help="entries in the store (10000)")
    add("--store-sessions", type=int, default=1000, help="sessions the entries belong to (1000)")
    add("--store-lookups", type=int, default=2000, help="lookups timed per kind (2000)")
    add("--seed", type=int, default=0, help="random seed (0)")
    add = parser.add_argument_group("part d: the disk tier").add_argument
    add("--d-sections", type=cli.names(D_SECTIONS), default=list(D_SECTIONS), help="sections (1,2,3)")
    add("--d-models", type=tiny, default=list(TINY_MODELS), help=f"d1, d2 models (llama,qwen3_next; {wide})")
    add("--d-servers", type=cli.names(D_SERVERS), default=list(D_DEFAULT_SERVERS), help=f"{','.join(D_SERVERS)}")
    add("--d-conversations", type=cli.positive_ints, default=D_CONVERSATIONS, help="d1: K values (8,32,128)")
    add("--d-turns", type=int, default=D_TURNS, help=f"d1, d2: turns per conversation ({D_TURNS})")
    add(
        "--d-budget-conversations", type=int, default=D_BUDGET_CONVERSATIONS, help="d1, d2: memory budget in states (8)"
    )
    add("--d-budget-bytes", type=int, default=None, help="d1, d2: the memory budget itself (default: derived)")
    add("--d-disk-bytes", type=int, default=D_DISK_BYTES, help=f"Courier's --prompt-cache-disk-bytes ({D_DISK_BYTES})")
    add("--d-restart-conversations", type=int, default=D_RESTART_CONVERSATIONS, help="d2: K (32)")
    signals = cli.names(tuple(D_STOP_SIGNALS))
    add("--d-restart-signals", type=signals, default=list(D_STOP_SIGNALS), help="d2: term,kill")
    add("--d-ttft-repeats", type=int, default=D_TTFT_REPEATS, help=f"d3: repeats ({D_TTFT_REPEATS})")
    add("--d-history-tokens", type=int, default=D_HISTORY_TOKENS, help=f"d3: prompt tokens ({D_HISTORY_TOKENS})")
    add("--d-ttft-max-tokens", type=int, default=D_TTFT_MAX_TOKENS, help=f"d3: max_tokens ({D_TTFT_MAX_TOKENS})")
    add("--d-ttft-capacity-bytes", type=int, default=None, help="d3: Courier's memory budget (default: measured)")
    cli.add_results(parser, openblas=MLX_LM_F32)
    cli.add_baseline(parser)
    args = parser.parse_args(argv)
    args.a_servers = cli.choose_servers(parser, "--a-servers", args.a_servers, A_SERVERS, args.baseline_tree)
    default_b = [label for label in B_SERVERS if label != COURIER_BASELINE and label not in QUANTIZED_COURIERS]
    args.b_servers = cli.choose_servers(parser, "--b-servers", args.b_servers, default_b, args.baseline_tree)
    args.d_restart_signals = [D_STOP_SIGNALS[name] for name in args.d_restart_signals]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = (("a", args.a_servers), ("b", args.b_servers), ("d", args.d_servers))
    servers = [name for part, names in chosen if part in args.parts for name in names]
    if openblas_missing(args.openblas, MLX_LM_F32 in servers, f"leave out {MLX_LM_F32}"):
        return 2
    if not baseline_ready(args.baseline_tree, servers):
        return 2
    blas = load_optimized_blas()  # before MLX is imported
    left_out = ("cache_dir", "json", "openblas", "run_timeout")
    settings = {key: value for key, value in vars(args).items() if key not in left_out}
    settings["d_restart_signals"] = [stop.name for stop in args.d_restart_signals]
    settings["baseline_tree"] = str(args.baseline_tree) if args.baseline_tree else None
    report = Report(environment=environment(blas), settings=settings)
    if {"a", "b", "d"} & set(args.parts):  # they share the 4-bit SmolLM2 (the tiny models borrow its tokenizer)
        with models.cache_directory(args.cache_dir) as cache_dir:
            logs, tree = cache_dir / "bench-logs", args.baseline_tree
            launcher = Launcher(
                bench="multiturn", cache_dir=cache_dir, log_dir=logs, openblas=args.openblas, baseline_tree=tree
            )
            progress("converting the embedded GGUF to a 4-bit MLX directory")
            dir4 = models.prepare_4bit_dir(cache_dir)
            for part, run in (("a", run_part_a), ("b", run_part_b), ("d", run_part_d)):
                if part in args.parts:
                    run(launcher, dir4, args, report)
            if "d" in args.parts and "3" in args.d_sections:
                run_part_d3(launcher, dir4, args, report)
    if "c" in args.parts:
        report.store = measure_store(args)
    print_report(report, args)
    write_json(report, args.json)
    return 1 if any(record.error for record in report.records()) else 0


if __name__ == "__main__":
    sys.exit(main())
