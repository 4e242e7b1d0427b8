"""bench.multiturn part d3: a long prompt's TTFT on SmolLM2 cold, from Courier's disk tier and from memory, beside
mlx_lm.server (cold and from memory: it has no disk tier)."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.harness.clients import Messages, async_client, user
from bench.harness.conversations import (
    GENERATION_PROMPT_TOKENS,
    Turn,
    ask,
    check_deadline,
    courier_stats,
    reset_cache,
    wait_until_idle,
)
from bench.harness.models import WARMUP_PROMPT, float32_dir
from bench.harness.report import ms, progress, table
from bench.harness.servers import COURIER, MLX_LM_F32, Launcher, Server, ServerRecord
from bench.harness.stats import median_or_none
from bench.multiturn_disk import disk_spec, fresh_prompt_dir, met, trouble
from bench.multiturn_interleaved import (
    REQUEST_TIMEOUT_S,
    TEXTS,
    WARM_UP_USER,
    fewest_words,
    handbook_words,
    is_courier,
    spec,
    warm_up,
)

if TYPE_CHECKING:
    from bench.multiturn import Report

D3_CAPACITY_ENTRIES = 2.5  # d3's memory budget, in snapshots of the conversation at rest
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


def run_part_d3(launcher: Launcher, dir4: Path, args: argparse.Namespace, report: Report) -> None:
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
