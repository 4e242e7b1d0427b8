"""bench.multiturn part d, the disk tier beside mlx_lm.server (which has none): d1 many interleaved conversations
with a memory budget for a few, d2 one more turn of each after a restart (d3, a disk hit's TTFT:
bench.multiturn_disk_ttft). It builds on part b's conversations (bench.multiturn_interleaved)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness.conversations import Turn, cached_share, courier_stats, ttft_p50, wait_until_idle, warm_share
from bench.harness.report import ms, percent, progress, table
from bench.harness.servers import MLX_LM_F32, Launcher, Server, ServerRecord, ServerSpec
from bench.multiturn_interleaved import (
    EQUAL_BUDGET,
    Run,
    TinyWorkload,
    histories_b,
    interleave,
    is_courier,
    part_b_spec,
    prepare_tiny,
    print_launches,
    run_cells,
    shares_text,
    spec,
    stat_cells,
)

if TYPE_CHECKING:
    from bench.multiturn import Report

D_TARGET_SHARE = 0.90


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """Part d2: K conversations, a stop by `stop`, a restart on the same directory, one more turn of each."""

    model: str
    label: str
    conversations: int
    stop: str
    before: ServerRecord
    after: ServerRecord | None
    idle_wait_s: float | None  # before a SIGKILL: how long until Courier was idle
    stats_at_stop: dict[str, Any] | None  # Courier, just before the signal
    stats_at_start: dict[str, Any] | None  # Courier, right after the restart (snapshot_disk_adopted)
    stats_after: dict[str, Any] | None  # Courier, after the next turns
    turns_before: list[Turn]
    turns_after: list[Turn]


# ---------------------------------------------------------------- part d: the disk tier


def fresh_prompt_dir(cache_dir: Path, name: str) -> Path:
    """An empty directory for one Courier run's `--prompt-cache-dir` (deleted by the caller afterwards)."""
    root = cache_dir / "bench-prompt-cache"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))


def disk_spec(
    label: str, model_dir: Path | None, budget_bytes: int, prompt_dir: Path | None, args: argparse.Namespace
) -> ServerSpec:
    """Courier with the memory budget, `--d-disk-bytes` of disk tier and its own directory; mlx_lm.server as at
    part b's equal budget."""
    if not is_courier(label):
        assert model_dir is not None, "mlx_lm.server needs a model directory"
        return part_b_spec(MLX_LM_F32, model_dir, EQUAL_BUDGET, budget_bytes, args)
    budgets = (
        "--prompt-cache-snapshot-capacity-bytes",
        str(budget_bytes),
        "--prompt-cache-disk-bytes",
        str(args.d_disk_bytes),
    )
    return spec(label, model_dir, *args.courier_arg, *budgets, "--prompt-cache-dir", str(prompt_dir))


D_PROGRESS = (
    *("snapshot_memory_entries", "snapshot_disk_entries", "snapshot_disk_hits", "snapshot_spills"),
    *("snapshot_disk_restores", "snapshot_disk_adopted", "snapshot_lookups_timed_out"),
    *("snapshot_disk_read_errors", "snapshot_disk_writes_refused", "snapshot_disk_restores_refused"),
)


def run_disk(launcher: Launcher, tiny: TinyWorkload, label: str, k: int, args: argparse.Namespace) -> Run:
    """Part d1: one (server, model, K), its cache reset after the warm-up once Courier is idle."""
    log_name = f"d1-{tiny.model}-{label}-k{k}"
    prompt_dir = fresh_prompt_dir(launcher.cache_dir, log_name) if is_courier(label) else None

    def measure(server: Server) -> tuple[list[Turn], dict[str, Any] | None]:
        turns = asyncio.run(interleave(server, histories_b(k, tiny.handbook), args, range(args.d_turns), settle=True))
        return turns, wait_until_idle(server)[0] if server.spec.is_courier else None

    started = time.monotonic()
    try:
        chosen = disk_spec(label, tiny.model_dir, tiny.budget.capacity_bytes, prompt_dir, args)
        record, result = launcher.run(chosen, measure, log_name=log_name)
    finally:
        if prompt_dir is not None:
            shutil.rmtree(prompt_dir, ignore_errors=True)
    wall_s = time.monotonic() - started
    turns, stats = result or ([], None)
    extra = "".join(f", {key} {stats.get(key)}" for key in D_PROGRESS if stats)
    progress(f"{log_name}: {shares_text(turns)}, {wall_s:.0f} s{extra}")
    budgets = {
        "budget_bytes": tiny.budget.capacity_bytes,
        "disk_bytes": args.d_disk_bytes if is_courier(label) else None,
    }
    return Run(
        model=tiny.model,
        budget="d1",
        conversations=k,
        server=record,
        turns=turns,
        stats=stats,
        wall_s=wall_s,
        **budgets,
    )


def run_restart(
    launcher: Launcher, tiny: TinyWorkload, label: str, stop: signal.Signals, args: argparse.Namespace
) -> Restart:
    """Part d2: K conversations, `stop`, a restart on the same directory, one more turn of each conversation. SIGTERM
    comes right after the last reply (a clean stop must flush what it holds itself); SIGKILL only once Courier is
    idle, so that it measures what write-behind kept, not a race with it."""
    k, courier = args.d_restart_conversations, is_courier(label)
    log_name = f"d2-{tiny.model}-{label}-k{k}-{stop.name}"
    prompt_dir = fresh_prompt_dir(launcher.cache_dir, log_name) if courier else None
    chosen = disk_spec(label, tiny.model_dir, tiny.budget.capacity_bytes, prompt_dir, args)
    histories = histories_b(k, tiny.handbook)

    def before(server: Server) -> tuple[list[Turn], float | None, dict[str, Any] | None]:
        done = asyncio.run(interleave(server, histories, args, range(args.d_turns), settle=True))
        if not courier:
            return done, None, None
        if stop == signal.SIGKILL:
            stats, idle_s = wait_until_idle(server)
            return done, idle_s, stats
        return done, None, courier_stats(server)

    def after(server: Server) -> tuple[list[Turn], dict[str, Any] | None, dict[str, Any] | None]:
        at_start = courier_stats(server) if courier else None
        done = asyncio.run(interleave(server, histories, args, range(args.d_turns, args.d_turns + 1), reset=False))
        return done, at_start, wait_until_idle(server)[0] if courier else None

    try:
        first, measured = launcher.run(chosen, before, log_name=f"{log_name}-1", stop=stop)
        turns_before, idle_s, at_stop = measured or ([], None, None)
        second, resumed = launcher.run(chosen, after, log_name=f"{log_name}-2") if measured else (None, None)
        turns_after, at_start, at_end = resumed or ([], None, None)
    finally:
        if prompt_dir is not None:
            shutil.rmtree(prompt_dir, ignore_errors=True)
    adopted = None if at_start is None else at_start.get("snapshot_disk_adopted")
    share_text = percent(cached_share(turns_after))
    progress(f"{log_name}: next turns after the restart: cached share {share_text}, adopted {adopted}")
    return Restart(
        model=tiny.model,
        label=label,
        conversations=k,
        stop=stop.name,
        before=first,
        after=second,
        idle_wait_s=idle_s,
        stats_at_stop=at_stop,
        stats_at_start=at_start,
        stats_after=at_end,
        turns_before=turns_before,
        turns_after=turns_after,
    )


def run_part_d(launcher: Launcher, dir4: Path, args: argparse.Namespace, report: Report) -> None:
    for model in args.d_models:
        tiny = prepare_tiny(model, launcher.cache_dir, dir4, args, part="d")
        report.disk_budgets.append(tiny.budget)
        progress(f"tiny {model} model: {tiny.model_dir}; part d memory budget {tiny.budget.capacity_bytes} B")
        if "1" in args.d_sections:
            started = time.monotonic()
            for k in args.d_conversations:
                report.disk_runs += [run_disk(launcher, tiny, label, k, args) for label in args.d_servers]
            report.wall_s[f"d1 {model}"] = time.monotonic() - started
        if "2" in args.d_sections:
            started = time.monotonic()
            for label in args.d_servers:
                # mlx_lm.server keeps nothing across a restart, however it stops: one clean stop shows it.
                for stop in args.d_restart_signals if is_courier(label) else args.d_restart_signals[:1]:
                    report.restarts.append(run_restart(launcher, tiny, label, stop, args))
            report.wall_s[f"d2 {model}"] = time.monotonic() - started


def met(value: float | None, target: float, *, at_most: bool = False) -> str:
    if value is None:
        return "n/a"
    return "met" if (value <= target if at_most else value >= target) else "MISSED"


D1_STATS = (
    *("snapshot_memory_entries", "snapshot_disk_entries", "snapshot_disk_hits", "snapshot_spills"),
    *("snapshot_disk_restores", "snapshot_disk_read_ms_mean", "snapshot_disk_write_ms_mean"),
    "snapshot_lookups_timed_out",
)
D2_STATS = ("snapshot_disk_hits", "snapshot_disk_restores", "snapshot_lookups_timed_out")
# Signs of trouble, printed under a table when any is not 0.
D_TROUBLE = (
    *("snapshot_lookups_timed_out", "snapshot_disk_read_errors", "snapshot_disk_unreadable"),
    *("snapshot_disk_write_errors", "snapshot_disk_write_failures", "snapshot_disk_write_losses"),
    *("snapshot_disk_writes_refused", "snapshot_disk_restores_refused", "snapshot_disk_evictions_lru"),
)


def trouble(stats: dict[str, Any] | None) -> str:
    return ", ".join(f"{key} {stats[key]}" for key in D_TROUBLE if stats.get(key)) if stats else ""


def print_part_d(report: Report, args: argparse.Namespace) -> None:
    print("### (d) The disk tier\n")
    print_launches(report.records()[len(report.conversation) + len(report.interleaved) :])
    for budget in report.disk_budgets:
        print(f"- memory budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print("- wall time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in report.wall_s.items()) + "\n")
    if report.disk_runs:
        print_part_d1(report, args)
    if report.restarts:
        print_part_d2(report)


def print_part_d1(report: Report, args: argparse.Namespace) -> None:
    print(
        f"#### (d1) K interleaved conversations, a memory budget for {args.d_budget_conversations} conversations, "
        "a disk tier\n"
    )
    table(
        "model | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ | TTFT p50 ms, turn 1 "
        "| empty replies | wall s | memory entries | disk entries | disk hits | spills | restores | read ms mean "
        "| write ms mean | lookups timed out",
        (
            f"{run.model} | {run.conversations} | {run.server.name} | {run_cells(run)} | {run.wall_s:.0f} "
            f"| {stat_cells(run.stats, D1_STATS)}"
            for run in report.disk_runs
        ),
    )
    for run in report.disk_runs:
        if problems := trouble(run.stats):
            print(f"- {run.model} K={run.conversations} {run.server.name}: {problems}")
    top = max(run.conversations for run in report.disk_runs)
    for run in (run for run in report.disk_runs if run.conversations == top):
        share_text = percent(cached_share(run.turns))
        if is_courier(run.server.name):
            print(
                f"- target, >= {D_TARGET_SHARE:.0%} of turns-2+ prompt tokens cached at K={top}, {run.model}: "
                f"{run.server.name} {share_text}, {met(cached_share(run.turns), D_TARGET_SHARE)}"
            )
        else:
            print(f"- {run.model}, K={top}: {run.server.name} {share_text}")
    print()


def print_part_d2(report: Report) -> None:
    print("#### (d2) After a restart: one more turn of every conversation\n")
    rows = []
    for run in report.restarts:
        failed = run.before.error is not None or run.after is None or run.after.error is not None
        stop_s = "n/a" if run.before.stop_s is None else f"{run.before.stop_s:.2f} ({run.before.exit_code})"
        last = max((turn.turn for turn in run.turns_before), default=0)
        warm = warm_share([turn for turn in run.turns_before if turn.turn == last] + run.turns_after)
        rows.append(
            f"{run.model} | {run.conversations} | {run.label} | {run.stop} | {percent(cached_share(run.turns_before))} "
            f"| {stop_s} | {stat_cells(run.stats_at_start, ('snapshot_disk_adopted',))} "
            f"| {'FAILED' if failed else percent(cached_share(run.turns_after))} "
            f"| {percent(warm)} | {ms(ttft_p50(run.turns_after))} | {stat_cells(run.stats_after, D2_STATS)}"
        )
    table(
        "model | K | server | stop | cached share before, turns 2+ | exit s (status) | adopted "
        "| next turn: cached share | next turns warm | TTFT p50 ms, next turn | disk hits | restores "
        "| lookups timed out",
        rows,
    )
    for run in report.restarts:
        if (stop := run.stats_at_stop) is not None:
            idle = "" if run.idle_wait_s is None else f" (idle after {run.idle_wait_s:.1f} s)"
            print(
                f"- {run.model} {run.stop}{idle}: at the signal {stop.get('snapshot_memory_entries')} entries in "
                f"memory, {stop.get('snapshot_disk_entries')} on disk, warm-ups pending "
                f"{stop.get('snapshot_warmups_pending')}, disk work pending {stop.get('snapshot_disk_pending')}"
            )
        if problems := trouble(run.stats_after):
            print(f"- {run.model} {run.label} {run.stop}, after the restart: {problems}")
    for run in report.restarts:
        if is_courier(run.label):
            after = cached_share(run.turns_after)
            print(
                f"- target, >= {D_TARGET_SHARE:.0%} of the next turns' prompt tokens cached after a restart, "
                f"{run.model}, {run.stop}: courier {percent(after)}, {met(after, D_TARGET_SHARE)}"
            )
    print()
