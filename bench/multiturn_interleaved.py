"""bench.multiturn part b, K conversations interleaved turn by turn on tiny models, at defaults and at an equal byte
budget; and what parts a, b and d share: their runs, servers, shares and report cells."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai

from bench.harness import cli, models
from bench.harness.clients import Messages, async_client, user
from bench.harness.conversations import (
    Turn,
    ask,
    cached_share,
    check_deadline,
    courier_stats,
    later,
    reset_cache,
    ttft_p50,
    wait_until_idle,
    warm_share,
)
from bench.harness.models import WARMUP_PROMPT
from bench.harness.report import ms, percent, progress, ratio_text, table
from bench.harness.servers import COURIER, COURIER_BASELINE, MLX_LM_F32, Launcher, Server, ServerRecord, ServerSpec
from bench.harness.servers import is_courier as courier_kind
from bench.harness.workloads import workload

if TYPE_CHECKING:
    from bench.multiturn import Report

# Courier storing its prompt cache's attention KV quantized (`--prompt-cache-bits`): asked for by name only.
COURIER_8BIT, COURIER_4BIT = "courier-8bit", "courier-4bit"
QUANTIZED_COURIERS = {COURIER_8BIT: 8, COURIER_4BIT: 4}
B_SERVERS = (COURIER, COURIER_BASELINE, MLX_LM_F32, *QUANTIZED_COURIERS)
DEFAULT_BUDGET, ANCHOR_BUDGET, EQUAL_BUDGET = "default", "size100", "equal"
B_BUDGETS = (DEFAULT_BUDGET, ANCHOR_BUDGET, EQUAL_BUDGET)
ANCHOR_CACHE_SIZE = 100  # the anchor: mlx_lm.server --prompt-cache-size 100
TINY_SERVED_NAME = "tiny"
COURIER_DEFAULT_MAX_ENTRIES = 4096  # `--prompt-cache-snapshot-max-entries` default, given to mlx_lm.server too
DEFAULT_SYSTEM_TOKENS_B = 550  # calibrated to the anchor (docs/benchmarks.md)
DEFAULT_MAX_TOKENS_B = 32  # an assistant reply of a sentence or two
EQUAL_CONVERSATIONS = [*range(4, 17), 20, 24]
BUDGET_STATES = 16
REFERENCE_K = 8
WARM_FRACTION = 0.8
REQUEST_TIMEOUT_S = 300.0
WARM_UP_USER = "bench-warm-up"


# The texts (bench/workloads/multiturn.toml): part a's system prompt and user turns; part b's handbook (each system
# prompt is a header naming its customer, then the handbook cut to `--b-system-tokens`) and questions.
TEXTS = workload("multiturn")
SYSTEM_PROMPT_A: str = TEXTS["system_prompt_a"]
USER_MESSAGES_A: tuple[str, ...] = tuple(TEXTS["user_messages_a"])
HANDBOOK_B: str = TEXTS["handbook_b"]
QUESTIONS_B: tuple[str, ...] = tuple(TEXTS["questions_b"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Conversations on one server process: part a's one, or part b's and d1's K interleaved (`budget_bytes`: at
    the equal budget, or d1's memory budget; `disk_bytes`: Courier's disk tier in d1)."""

    server: ServerRecord
    turns: list[Turn]
    stats: dict[str, Any] | None  # Courier's /v1/cache/stats after the last turn (once idle, in d1)
    model: str = ""
    budget: str = ""
    conversations: int = 1
    budget_bytes: int | None = None
    disk_bytes: int | None = None
    wall_s: float | None = None  # d1: the server process, from its start to its exit


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteBudget:
    model: str
    capacity_bytes: int
    explanation: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyWorkload:
    """A tiny model, the handbook text its conversations' system prompts use, and its byte budget."""

    model: str
    model_dir: Path
    handbook: str
    budget: ByteBudget


def is_courier(label: str) -> bool:
    """A Courier server under any of this bench's names (those storing quantized snapshots too)."""
    return courier_kind(label) or label in QUANTIZED_COURIERS


def spec(label: str, model_dir: Path | None, *flags: str) -> ServerSpec:
    """Courier on `model_dir` (a tiny model served as "tiny"; None: the embedded SmolLM2), or mlx_lm.server."""
    served = TINY_SERVED_NAME if is_courier(label) and model_dir is not None else None
    if label in QUANTIZED_COURIERS:
        bits = ("--prompt-cache-bits", str(QUANTIZED_COURIERS[label]))
        return ServerSpec(name=label, kind=COURIER, model_dir=model_dir, served_name=served, flags=(*flags, *bits))
    return ServerSpec(name=label, model_dir=model_dir, served_name=served, flags=flags)


async def warm_up(client: openai.AsyncOpenAI, model: str) -> None:
    await ask(client, model, user(WARMUP_PROMPT), 8, user_id=WARM_UP_USER, at=(0, 0))


def run_cells(run: Run) -> str:
    """cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ | TTFT p50 ms, turn 1 | empty replies"""
    share_text = "FAILED" if run.server.error is not None else percent(cached_share(run.turns))
    first = [turn for turn in run.turns if turn.turn == 1]
    empty = sum(not turn.reply.content_deltas for turn in run.turns)
    later_p50, first_p50 = ms(ttft_p50(later(run.turns))), ms(ttft_p50(first))
    return f"{share_text} | {percent(warm_share(run.turns))} | {later_p50} | {first_p50} | {empty}"


def shares_text(turns: Sequence[Turn]) -> str:
    return f"cached share {percent(cached_share(turns))}, warm turns {percent(warm_share(turns))}"


def with_stats(server: Server, turns: list[Turn]) -> tuple[list[Turn], dict[str, Any] | None]:
    return turns, courier_stats(server) if server.spec.is_courier else None


def system_prompt_b(k: int, index: int, handbook: str) -> str:
    return f"You are the support assistant for customer {index + 1} of {k}, account AC-{k:02d}{index:04d}. {handbook}"


def user_message_b(index: int, turn: int) -> str:
    return f"Message {turn + 1}: {QUESTIONS_B[(index + turn) % len(QUESTIONS_B)]}"


def handbook_words(count: int) -> str:
    """The first `count` words of HANDBOOK_B, repeated from its start when it is too short."""
    words = HANDBOOK_B.split()
    return " ".join(words[index % len(words)] for index in range(count))


def fewest_words(measure: Callable[[int], int], tokens: int) -> int:
    """The fewest handbook words whose text `measure`s at least `tokens` long."""
    low, high = 0, len(HANDBOOK_B.split())
    while measure(high) < tokens:
        high *= 2
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if measure(middle) < tokens else (low, middle)
    return low


def state_bytes(model: Any, tokens: Sequence[int]) -> int:
    """The bytes of mlx-lm's cache after `tokens`, contents only (a KV cache's growth buffer not counted)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([list(tokens)]), cache=cache)
    arrays: list[Any] = []
    for layer in cache:
        if isinstance(layer, KVCache):
            arrays += layer.keys_and_values()
        else:
            arrays += [value for _, value in tree_flatten(layer.state) if isinstance(value, mx.array)]
    mx.eval(arrays)
    return sum(array.nbytes for array in arrays)


def prepare_tiny(model: str, cache_dir: Path, dir4: Path, args: argparse.Namespace, *, part: str) -> TinyWorkload:
    """The handbook text for `--b-system-tokens`, and a byte budget: part b's `--budget-states` (part d's
    `--d-budget-conversations`) model states of a conversation at its last prompt, weighed in this process on
    mlx-lm's own cache (or `--budget-bytes`, `--d-budget-bytes`)."""
    from mlx_lm import load

    states, turns, fixed = (
        (args.budget_states, args.b_turns, args.budget_bytes)
        if part == "b"
        else (args.d_budget_conversations, args.d_turns, args.d_budget_bytes)
    )
    model_dir = models.tiny_model(model, dir4, cache_dir)
    loaded, tokenizer = load(str(model_dir))

    def measure(count: int) -> int:
        return len(tokenizer.encode(system_prompt_b(32, 31, handbook_words(count)), add_special_tokens=False))

    handbook = handbook_words(fewest_words(measure, args.b_system_tokens))
    system = len(tokenizer.encode(system_prompt_b(32, 0, handbook), add_special_tokens=False))
    messages = [{"role": "system", "content": system_prompt_b(32, 0, handbook)}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "assistant", "content": " ".join(["ok"] * args.b_max_tokens)})
        messages.append({"role": "user", "content": user_message_b(0, turn)})
    last = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    one_state = state_bytes(loaded, last)
    del loaded
    models.release_mlx_memory()
    workload = (
        f"system prompt {system} tokens, last prompt of a conversation about {len(last)} tokens, one model state "
        f"there {one_state} B (mlx-lm cache contents)"
    )
    if fixed is not None:
        flag = "--budget-bytes" if part == "b" else "--d-budget-bytes"
        budget = ByteBudget(model=model, capacity_bytes=fixed, explanation=f"{flag}; {workload}")
    else:
        explanation = f"{states} model states of {one_state} B; {workload}"
        budget = ByteBudget(model=model, capacity_bytes=states * one_state, explanation=explanation)
    return TinyWorkload(model=model, model_dir=model_dir, handbook=handbook, budget=budget)


def histories_b(k: int, handbook: str) -> list[Messages]:
    """K conversations, each its system prompt so far."""
    return [[{"role": "system", "content": system_prompt_b(k, index, handbook)}] for index in range(k)]


async def interleaved_round(
    client: openai.AsyncOpenAI, model: str, histories: Sequence[Messages], turn: int, *, k: int, max_tokens: int
) -> list[Turn]:
    """Turn `turn` (from 0) of every conversation, in order, each as its own `user`; each reply joins its history."""
    turns = []
    for index, messages in enumerate(histories):
        messages.append({"role": "user", "content": user_message_b(index, turn)})
        at, user_id = (index + 1, turn + 1), f"k{k}-conversation-{index + 1}"
        turns.append(await ask(client, model, messages, max_tokens, user_id=user_id, at=at))
        messages.append({"role": "assistant", "content": turns[-1].reply.text})
    return turns


async def interleave(
    server: Server,
    histories: list[Messages],
    args: argparse.Namespace,
    turns: range,
    *,
    reset: bool = True,
    settle: bool = False,
) -> list[Turn]:
    """Turns `turns` (from 0) of the conversations in `histories`, interleaved turn by turn, after a warm-up request
    (and, on Courier with `reset`, a cache reset that forgets it; with `settle` only once Courier is idle, or the
    warm-up's own idle warm-up may land after the reset)."""
    deadline, k, results = time.monotonic() + args.run_timeout, len(histories), []
    async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, server.spec.model)
        if server.spec.is_courier and reset:
            if settle:
                wait_until_idle(server)
            reset_cache(server)
        for turn in turns:
            check_deadline(deadline, f"{server.spec.name} K={k}")
            model, max_tokens = server.spec.model, args.b_max_tokens
            results += await interleaved_round(client, model, histories, turn, k=k, max_tokens=max_tokens)
    return results


def part_b_spec(
    label: str, model_dir: Path, budget: str, budget_bytes: int | None, args: argparse.Namespace
) -> ServerSpec:
    if is_courier(label):
        extra = ["--prompt-cache-snapshot-capacity-bytes", str(budget_bytes)] if budget == EQUAL_BUDGET else []
        return spec(label, model_dir, *args.courier_arg, *extra)
    flags = ["--log-level", "WARNING"]
    if budget == ANCHOR_BUDGET:
        flags += ["--prompt-cache-size", str(ANCHOR_CACHE_SIZE)]
    elif budget == EQUAL_BUDGET:
        flags += ["--prompt-cache-bytes", str(budget_bytes), "--prompt-cache-size", str(COURIER_DEFAULT_MAX_ENTRIES)]
    return spec(MLX_LM_F32, model_dir, *flags)


def part_b_plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(budget, server, K) of every run, in order: defaults, the size-100 anchor, then the equal-budget sweep; the
    two Courier servers alternate K by K (so drift on a noisy machine hits both alike)."""
    plan: list[tuple[str, str, int]] = []
    for budget in args.b_budgets:
        labels = [label for label in args.b_servers if budget != ANCHOR_BUDGET or label == MLX_LM_F32]
        groups: list[list[str]] = []
        for label in cli.in_run_order(labels):
            if is_courier(label) and groups and is_courier(groups[-1][0]):
                groups[-1].append(label)
            else:
                groups.append([label])
        ks = args.equal_conversations if budget == EQUAL_BUDGET else args.conversations
        plan += [(budget, label, k) for group in groups for k in ks for label in group]
    return plan


def run_part_b(launcher: Launcher, dir4: Path, args: argparse.Namespace, report: Report) -> None:
    for model in args.b_models:
        tiny = prepare_tiny(model, launcher.cache_dir, dir4, args, part="b")
        budget = tiny.budget.capacity_bytes
        progress(f"tiny {model} model: {tiny.model_dir}; equal byte budget {budget} B ({tiny.budget.explanation})")
        if EQUAL_BUDGET in args.b_budgets:
            report.budgets.append(tiny.budget)
        for name, label, k in part_b_plan(args):

            def measure(server: Server, k: int = k, handbook: str = tiny.handbook) -> tuple[list[Turn], Any]:
                return with_stats(
                    server, asyncio.run(interleave(server, histories_b(k, handbook), args, range(args.b_turns)))
                )

            log_name = f"b-{model}-{label}-{name}-k{k}"
            chosen = part_b_spec(label, tiny.model_dir, name, budget, args)
            record, result = launcher.run(chosen, measure, log_name=log_name)
            turns, stats = result or ([], None)
            equal = budget if name == EQUAL_BUDGET else None
            run = Run(
                model=model, budget=name, conversations=k, server=record, turns=turns, stats=stats, budget_bytes=equal
            )
            report.interleaved.append(run)
            keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions", "snapshot_bytes_per_entry")
            progress(
                f"{log_name}: {shares_text(turns)}" + "".join(f", {key} {stats.get(key)}" for key in keys if stats)
            )


def held_warm(runs: Sequence[Run], model: str, label: str) -> tuple[float | None, float | None, int | None, bool]:
    """At the equal budget: `label`'s share with an unconstrained cache at K=REFERENCE_K (Courier's default,
    mlx_lm.server's --prompt-cache-size 100), the threshold (WARM_FRACTION of it), the largest swept K up to which
    every share stays >= the threshold, and whether that is the sweep's end."""
    mine = [run for run in runs if run.model == model and run.server.name == label]
    unconstrained = DEFAULT_BUDGET if is_courier(label) else ANCHOR_BUDGET
    reference = next(
        (cached_share(r.turns) for r in mine if (r.budget, r.conversations) == (unconstrained, REFERENCE_K)), None
    )
    swept = sorted((r for r in mine if r.budget == EQUAL_BUDGET), key=lambda r: r.conversations)
    if reference is None or not swept:
        return reference, None, None, False
    threshold, held = WARM_FRACTION * reference, 0
    for run in swept:
        if (value := cached_share(run.turns)) is None or value < threshold:
            break
        held = run.conversations
    return reference, threshold, held, held == swept[-1].conversations


def print_launches(records: Sequence[ServerRecord]) -> None:
    """Each distinct command once (its port and prompt-cache directory written as PORT and DIR), then failures."""
    for text, name in {record.command_text(): record.name for record in records if record.command}.items():
        print(f"- `{name}`: `{text}`")
    for record in records:
        if record.error is not None:
            print(f"- FAILED `{record.name}` ({record.command_text()}): {record.error.splitlines()[0]}")
    print()


def count_text(count: float | None) -> str:
    return "n/a" if count is None else f"{count:.0f}"


def baseline_line(where: str, ours: Sequence[Turn], theirs: Sequence[Turn]) -> str:
    """courier / courier-baseline: cached share (above 1 favours courier) and TTFT p50 (below 1 does) of turns 2+."""
    shares = ratio_text(cached_share(ours), cached_share(theirs), percent)
    ttfts = ratio_text(ttft_p50(later(ours)), ttft_p50(later(theirs)), ms)
    return f"- courier / courier-baseline{where}: cached share, turns 2+ {shares}; TTFT p50 ms, turns 2+ {ttfts}"


def budget_label(run: Run) -> str:
    if run.budget == EQUAL_BUDGET:
        return f"equal ({run.budget_bytes} B)"
    return f"--prompt-cache-size {ANCHOR_CACHE_SIZE}" if run.budget == ANCHOR_BUDGET else run.budget


def stat_cells(stats: dict[str, Any] | None, keys: Sequence[str]) -> str:
    if stats is None:
        return " | ".join("-" for _ in keys)
    return " | ".join(f"{v:.2f}" if isinstance(v := stats.get(key, "?"), float) else str(v) for key in keys)


def print_part_b(runs: Sequence[Run], budgets: Sequence[ByteBudget], args: argparse.Namespace) -> None:
    print("### (b) K interleaved conversations, tiny models\n")
    print_launches([run.server for run in runs])
    for budget in budgets:
        print(f"- equal budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print()
    order = {name: index for index, name in enumerate(B_BUDGETS)}
    evictions = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions")
    table(
        "model | budget | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ "
        "| TTFT p50 ms, turn 1 | empty replies | courier entries | evictions_lru | self_evictions",
        (
            f"{run.model} | {budget_label(run)} | {run.conversations} | {run.server.name} | {run_cells(run)} "
            f"| {stat_cells(run.stats, evictions)}"
            for run in sorted(runs, key=lambda r: (r.model, order[r.budget], r.server.name, r.conversations))
        ),
    )
    baseline = {(r.model, r.budget, r.conversations): r for r in runs if r.server.name == COURIER_BASELINE}
    pairs = [
        (run, baseline[key])
        for run in runs
        if run.server.name == COURIER and (key := (run.model, run.budget, run.conversations)) in baseline
    ]
    for ours, theirs in pairs:
        print(baseline_line(f", {ours.model}, {budget_label(ours)}, K={ours.conversations}", ours.turns, theirs.turns))
    print("\n" if pairs else "", end="")
    if EQUAL_BUDGET in args.b_budgets:
        print_held_warm(runs, args)


def print_held_warm(runs: Sequence[Run], args: argparse.Namespace) -> None:
    print(
        f"Conversations held warm at the equal budget: the largest swept K up to which the cached share stays >= "
        f"{WARM_FRACTION:.0%} of the server's own share with an unconstrained cache at K={REFERENCE_K}.\n"
    )
    held = {(model, label): held_warm(runs, model, label) for model in args.b_models for label in args.b_servers}
    table(
        "model | server | unconstrained share | threshold | conversations held warm",
        (
            f"{model} | {label} | {percent(reference)} | {percent(threshold)} "
            f"| {'n/a' if count is None else ('>= ' if at_least else '') + str(count)}"
            for (model, label), (reference, threshold, count, at_least) in held.items()
        ),
    )
    for model in args.b_models:
        mine = held.get((model, COURIER), (None, None, None, False))[2]
        peer = held.get((model, MLX_LM_F32), (None, None, None, False))[2]
        if mine is not None and peer:
            capped = any(held[model, label][3] for label in args.b_servers)
            note = " (a count reached the end of the sweep: widen --equal-conversations)" if capped else ""
            print(f"- {model}: courier / mlx_lm.server = {mine} / {peer} = {mine / peer:.2f}x{note}")
        else:
            print(f"- {model}: courier {mine}, mlx_lm.server {peer}: no ratio")
        if (model, COURIER_BASELINE) in held:
            count = ratio_text(mine, held[model, COURIER_BASELINE][2], count_text)
            print(f"- {model}: courier / courier-baseline = {count}")
        for label in (label for label in QUANTIZED_COURIERS if (model, label) in held):
            quantized = held[model, label][2]
            print(
                f"- {model}: {label} / courier = {ratio_text(quantized, mine, count_text)}, {label} / mlx_lm.server "
                f"= {ratio_text(quantized, peer, count_text)} (goals: 8-bit >= 1.9x, 4-bit >= 3.5x courier's count)"
            )
    print()
