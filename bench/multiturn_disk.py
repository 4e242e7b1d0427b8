"""bench.multiturn part d, the disk tier beside mlx_lm.server (which has none): d1 many interleaved conversations
with a memory budget for a few, d2 one more turn of each after a restart, d3 a long prompt's TTFT cold, from disk
and from memory. It builds on bench.multiturn's conversations and servers."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.clients import Messages, async_client, user
from bench.harness.conversations import (
    GENERATION_PROMPT_TOKENS,
    Turn,
    ask,
    cached_share,
    check_deadline,
    courier_stats,
    reset_cache,
    ttft_p50,
    wait_until_idle,
    warm_share,
)
from bench.harness.models import WARMUP_PROMPT, float32_dir
from bench.harness.report import ms, percent, progress, table
from bench.harness.servers import COURIER, MLX_LM_F32, Launcher, Server, ServerRecord, ServerSpec
from bench.harness.stats import median_or_none
from bench.multiturn import (
    EQUAL_BUDGET,
    REQUEST_TIMEOUT_S,
    TEXTS,
    WARM_UP_USER,
    Report,
    Run,
    TinyWorkload,
    fewest_words,
    handbook_words,
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
    warm_up,
)

D3_CAPACITY_ENTRIES = 2.5  # d3's memory budget, in snapshots of the conversation at rest
D_TARGET_SHARE = 0.90
D_TARGET_TTFT_RATIO = 0.3
COLD_CACHED_SLACK = 32  # a cold request may still find a few template tokens another conversation shares
COLD, FILLER, DISK_HIT, MEMORY_HIT = "cold", "filler (cold)", "disk hit", "memory hit"
D3_KINDS = (COLD, FILLER, DISK_HIT, MEMORY_HIT)
D3_TARGET_USER, D3_FILLER_USER = "d3-target", "d3-filler"
D3_TARGET_CUSTOMER, D3_FILLER_CUSTOMER = 1, 2
D3_MLX_CUSTOMERS = 100  # mlx_lm.server's cold prompts: customers 100, 101, ... (no two share a history)
# d3's conversation: a customer header and the handbook, three exchanges written out, and a question.
D3_EXCHANGES: tuple[tuple[str, str], ...] = tuple((question, answer) for question, answer in TEXTS["d3_exchanges"])
D3_QUESTION: str = TEXTS["d3_question"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TtftSample:
    """Part d3: one timed request, the growth of Courier's counters over it, and whether it was what its kind says."""

    kind: str
    repeat: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None
    gained: dict[str, int]  # snapshot_disk_hits, _memory_hits, _disk_restores, _lookups_timed_out (Courier only)
    verified: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTtft:
    """Part d3 on one server: a long prompt's TTFT cold and from each tier."""

    server: ServerRecord
    probe: ServerRecord | None = None  # Courier: the memory-only server that weighed the conversation's snapshot
    entry_bytes: int | None = None  # the conversation's snapshot at rest, as Courier counts it
    capacity_bytes: int | None = None  # the memory budget the measured Courier ran with
    samples: list[TtftSample] = field(default_factory=list)
    stats: dict[str, Any] | None = None


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


def d3_conversation(customer: int, words: str) -> Messages:
    """d3's conversation: a long system prompt, three exchanges written out, and the question to answer."""
    system = f"You are the support assistant for customer {customer}, account AC-{customer:06d}. {words}"
    messages: Messages = [{"role": "system", "content": system}]
    for question, answer in D3_EXCHANGES:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": D3_QUESTION}]


GAINED = ("snapshot_disk_hits", "snapshot_memory_hits", "snapshot_disk_restores", "snapshot_lookups_timed_out")
GAINED_SHOWN = ("snapshot_disk_hits", "snapshot_memory_hits", "snapshot_lookups_timed_out")


def ttft_sample(
    kind: str, repeat: int, turn: Turn, before: dict[str, Any] | None, after: dict[str, Any] | None
) -> TtftSample:
    """A timed request, verified: a cold one found (almost) nothing cached; a hit found at least the whole history
    (the prompt but its generation prompt) cached, a disk hit with snapshot_disk_hits grown on it, a memory hit with
    snapshot_memory_hits grown and snapshot_disk_hits not (mlx_lm.server's hits by cached_tokens alone)."""
    cached = turn.cached_tokens or 0
    gained = {key: int(after.get(key, 0)) - int(before.get(key, 0)) for key in GAINED} if before and after else {}
    whole = cached >= turn.prompt_tokens - GENERATION_PROMPT_TOKENS
    if kind in (COLD, FILLER):
        verified = cached <= COLD_CACHED_SLACK
    elif kind == DISK_HIT:
        verified = whole and gained.get("snapshot_disk_hits", 0) >= 1
    else:
        verified = whole and (not gained or (not gained["snapshot_disk_hits"] and bool(gained["snapshot_memory_hits"])))
    return TtftSample(
        kind=kind,
        repeat=repeat,
        ttft_s=turn.reply.ttft_s,
        prompt_tokens=turn.prompt_tokens,
        cached_tokens=turn.cached_tokens,
        gained=gained,
        verified=verified,
    )


async def ask_once(server: Server, messages: Messages, user_id: str, args: argparse.Namespace) -> Turn:
    async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
        return await ask(client, server.spec.model, messages, args.d_ttft_max_tokens, user_id=user_id)


def weigh_snapshot(launcher: Launcher, target: Messages, args: argparse.Namespace) -> tuple[ServerRecord, int | None]:
    """A memory-only Courier answers d3's conversation once and, idle, weighs its snapshot at rest."""

    def weigh(server: Server) -> dict[str, Any]:
        asyncio.run(ask_once(server, user(WARMUP_PROMPT), WARM_UP_USER, args))
        wait_until_idle(server)
        reset_cache(server)
        asyncio.run(ask_once(server, target, D3_TARGET_USER, args))
        stats, _ = wait_until_idle(server)
        progress(
            f"d3 probe: {stats.get('snapshot_entries')} entries, {stats.get('snapshot_bytes_per_entry')} B an entry"
        )
        return stats

    memory_only = spec(COURIER, None, *args.courier_arg, "--prompt-cache-disk-bytes", "0")
    probe, stats = launcher.run(memory_only, weigh, log_name="d3-courier-probe")
    return probe, int(stats.get("snapshot_bytes_per_entry", 0)) if stats else None


def courier_ttft(launcher: Launcher, target: Messages, filler: Messages, args: argparse.Namespace) -> DiskTtft:
    """d3 on Courier, at a memory budget of D3_CAPACITY_ENTRIES snapshots (or --d-ttft-capacity-bytes): per repeat,
    reset, the target prompt cold; the filler conversation cold (its snapshots push the target's out of memory); the
    target again (a disk hit); and once more (a memory hit). Courier is idle before every timed request and reset."""
    probe, entry, capacity = None, None, args.d_ttft_capacity_bytes
    if capacity is None:
        probe, entry = weigh_snapshot(launcher, target, args)
        if not entry:
            error = f"probe failed: {probe.error or 'no snapshot held'}"
            failed = ServerRecord(name=COURIER, command=[], extra_env={}, log_path="", error=error)
            return DiskTtft(server=failed, probe=probe, entry_bytes=entry)
        capacity = int(entry * D3_CAPACITY_ENTRIES)
    prompt_dir = fresh_prompt_dir(launcher.cache_dir, "d3-courier")
    order = [(COLD, target, D3_TARGET_USER), (FILLER, filler, D3_FILLER_USER), (DISK_HIT, target, D3_TARGET_USER)]
    order.append((MEMORY_HIT, target, D3_TARGET_USER))

    def measure(server: Server) -> tuple[list[TtftSample], dict[str, Any]]:
        deadline, samples = time.monotonic() + args.run_timeout, []
        asyncio.run(ask_once(server, user(WARMUP_PROMPT), WARM_UP_USER, args))
        for repeat in range(args.d_ttft_repeats):
            check_deadline(deadline, "d3 courier")
            wait_until_idle(server)
            reset_cache(server)
            for kind, messages, user_id in order:
                before, _ = wait_until_idle(server)
                turn = asyncio.run(ask_once(server, messages, user_id, args))
                samples.append(ttft_sample(kind, repeat, turn, before, courier_stats(server)))
                progress(
                    f"d3 courier #{repeat + 1} {kind}: TTFT {ms(samples[-1].ttft_s)} ms, cached {turn.cached_tokens}, "
                    f"{samples[-1].gained}, verified {samples[-1].verified}"
                )
        return samples, courier_stats(server)

    try:
        chosen = disk_spec(COURIER, None, capacity, prompt_dir, args)
        record, result = launcher.run(chosen, measure, log_name="d3-courier")
    finally:
        shutil.rmtree(prompt_dir, ignore_errors=True)
    samples, stats = result or ([], None)
    sizes = {"entry_bytes": entry, "capacity_bytes": capacity}
    return DiskTtft(server=record, probe=probe, samples=samples, stats=stats, **sizes)


def mlx_ttft(launcher: Launcher, dir4: Path, words: str, args: argparse.Namespace) -> DiskTtft:
    """d3's context on mlx_lm.server (float32 SmolLM2, as part a): per repeat, a prompt like Courier's but for
    another customer (cold), then the same prompt again (a memory hit). It has no disk tier."""
    progress("dequantizing the 4-bit SmolLM2 directory to float32 for mlx-lm-f32")
    chosen = spec(MLX_LM_F32, float32_dir(dir4, launcher.cache_dir), "--log-level", "WARNING")

    async def measure(server: Server) -> list[TtftSample]:
        deadline, samples = time.monotonic() + args.run_timeout, []
        async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
            await warm_up(client, server.spec.model)
            for repeat in range(args.d_ttft_repeats):
                check_deadline(deadline, "d3 mlx_lm.server")
                messages = d3_conversation(D3_MLX_CUSTOMERS + repeat, words)
                for kind in (COLD, MEMORY_HIT):
                    turn = await ask(client, server.spec.model, messages, args.d_ttft_max_tokens)
                    samples.append(ttft_sample(kind, repeat, turn, None, None))
                    progress(f"d3 mlx-lm-f32 #{repeat + 1} {kind}: TTFT {ms(turn.reply.ttft_s)} ms")
        return samples

    record, samples = launcher.run(chosen, lambda server: asyncio.run(measure(server)), log_name="d3-mlx-lm-f32")
    return DiskTtft(server=record, samples=samples or [])


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
    if "3" in args.d_sections:
        from mlx_lm.utils import load_tokenizer

        started = time.monotonic()
        tokenizer = load_tokenizer(dir4)

        def measure(count: int) -> int:
            messages = d3_conversation(D3_TARGET_CUSTOMER, handbook_words(count))
            return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

        words = handbook_words(fewest_words(measure, args.d_history_tokens))
        if COURIER in args.d_servers:
            target, filler = (d3_conversation(customer, words) for customer in (D3_TARGET_CUSTOMER, D3_FILLER_CUSTOMER))
            report.ttft.append(courier_ttft(launcher, target, filler, args))
        if MLX_LM_F32 in args.d_servers:
            report.ttft.append(mlx_ttft(launcher, dir4, words, args))
        report.wall_s["d3"] = time.monotonic() - started


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
    if report.ttft:
        print_part_d3(report)


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


def verified(item: DiskTtft, kind: str) -> list[float]:
    return [sample.ttft_s for sample in item.samples if sample.kind == kind and sample.verified]


def print_part_d3(report: Report) -> None:
    tokens = next((sample.prompt_tokens for item in report.ttft for sample in item.samples), None)
    print(f"#### (d3) TTFT of a {tokens}-token prompt on SmolLM2: cold, from disk, from memory\n")
    for item in report.ttft:
        if item.capacity_bytes is not None and item.entry_bytes is not None:
            print(
                f"- {item.server.name}: memory budget {item.capacity_bytes} B ({D3_CAPACITY_ENTRIES} snapshots of "
                f"{item.entry_bytes} B, the conversation's at rest as a memory-only Courier weighed it)"
            )
        elif item.capacity_bytes is not None:
            print(f"- {item.server.name}: memory budget {item.capacity_bytes} B (--d-ttft-capacity-bytes)")
    print()

    def gained(samples: Sequence[TtftSample], key: str) -> str:
        return str(sum(sample.gained[key] for sample in samples)) if samples and samples[0].gained else "-"

    rows = []
    for item in report.ttft:
        for kind in D3_KINDS:
            if samples := [sample for sample in item.samples if sample.kind == kind]:
                ttfts = verified(item, kind)
                low, high = (min(ttfts), max(ttfts)) if ttfts else (None, None)
                rows.append(
                    f"{item.server.name} | {kind} | {len(ttfts)}/{len(samples)} | {ms(median_or_none(ttfts))} "
                    f"| {ms(low)} | {ms(high)} | {samples[0].prompt_tokens} "
                    f"| {statistics.median(sample.cached_tokens or 0 for sample in samples):.0f} "
                    f"| {' | '.join(gained(samples, key) for key in GAINED_SHOWN)}"
                )
    table(
        "server | measure | verified | TTFT p50 ms | min ms | max ms | prompt tokens | cached tokens, median "
        "| disk hits gained | memory hits gained | lookups timed out",
        rows,
    )
    for item in report.ttft:
        print_d3_lines(item)
    print()


def print_d3_lines(item: DiskTtft) -> None:
    if item.server.error is not None:
        print(f"- {item.server.name} FAILED: {item.server.error.splitlines()[0]}")
    cold = median_or_none(verified(item, COLD))
    if not is_courier(item.server.name):
        print(f"- {item.server.name}: cold TTFT p50 {ms(cold)} ms (no disk tier)")
        return
    disk, memory = median_or_none(verified(item, DISK_HIT)), median_or_none(verified(item, MEMORY_HIT))
    ratio = None if disk is None or not cold else disk / cold
    print(
        f"- target, TTFT p50 of a disk hit <= {D_TARGET_TTFT_RATIO}x a cold prefill: {ms(disk)} / {ms(cold)} ms = "
        f"{'n/a' if ratio is None else f'{ratio:.3f}x'}, {met(ratio, D_TARGET_TTFT_RATIO, at_most=True)}"
    )
    if memory is not None and cold:
        print(f"- memory hit / cold: {ms(memory)} / {ms(cold)} ms = {memory / cold:.3f}x")
    if problems := trouble(item.stats):
        print(f"- courier: {problems}")
