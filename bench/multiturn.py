"""Multi-turn prompt caching of Courier against mlx_lm.server: (a) one long conversation on SmolLM2, (b) K
conversations interleaved on tiny models, at defaults and at an equal byte budget, (c) the snapshot store's latency
in process, (d) the disk tier: many conversations, a restart, and a disk hit's TTFT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.harness import cli
from bench.harness.clients import Messages, Streamed, async_client, stream_chat, user
from bench.harness.models import (
    TINY_MODELS,
    WARMUP_PROMPT,
    WIDE_TINY_MODELS,
    cache_directory,
    float32_dir,
    prepare_4bit_dir,
    release_mlx_memory,
    tiny_model,
)
from bench.harness.report import environment, head, ms, percent, progress, table, write_json
from bench.harness.servers import (
    COURIER,
    COURIER_BASELINE,
    MLX_LM_4BIT,
    MLX_LM_F32,
    BenchmarkError,
    Launcher,
    Server,
    ServerRecord,
    ServerSpec,
    baseline_ready,
    openblas_missing,
)
from bench.harness.servers import is_courier as courier_kind
from bench.harness.stats import median_or_none, percentile, share
from courier.platform.blas import load_optimized_blas

PARTS = ("a", "b", "c", "d")
DEFAULT_PARTS = ("a", "b", "c")  # part d only when asked for: it starts 23 servers and takes about 27 minutes
A_SERVERS = (COURIER, MLX_LM_F32, MLX_LM_4BIT)
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
GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": re-rendered with the reply, so a warm turn may redo it
REQUEST_TIMEOUT_S = 300.0
WARM_UP_USER = "bench-warm-up"

# Part c.
STORE_PREFIX_TOKENS = 500
STORE_SUFFIX_TOKENS = (50, 1500)
STORE_VOCAB = 49152
STORE_NEXT_TURN_TOKENS = 30
STORE_NEW_CONVERSATION_TOKENS = 200
STORE_MISS_TOKENS = 700
STORE_MIN_PREFIX = 32
STORE_LOOKUP_TARGET_US = 1000.0
LOOKUP_NEXT_TURN = "lookup: next turn (hit, whole entry)"
LOOKUP_SHARED_PREFIX = "lookup: new conversation (hit, shared prefix)"
LOOKUP_MISS = "lookup: unrelated prompt (miss)"

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
D3_CAPACITY_ENTRIES = 2.5  # d3's memory budget, in snapshots of the conversation at rest
D_TARGET_SHARE = 0.90
D_TARGET_TTFT_RATIO = 0.3
COLD_CACHED_SLACK = 32  # a cold request may still find a few template tokens another conversation shares
IDLE_POLL_S = 0.2
IDLE_TIMEOUT_S = 300.0
# Counters that move while Courier still works for its cache between requests: warm-ups, inserts, disk writes.
IDLE_COUNTERS = (
    *("snapshot_warmups_queued", "snapshot_warmups_run", "snapshot_warmups_skipped", "snapshot_inserts"),
    *("snapshot_disk_writes", "snapshot_disk_writes_skipped"),
)
COLD, FILLER, DISK_HIT, MEMORY_HIT = "cold", "filler (cold)", "disk hit", "memory hit"
D3_KINDS = (COLD, FILLER, DISK_HIT, MEMORY_HIT)
D3_TARGET_USER, D3_FILLER_USER = "d3-target", "d3-filler"
D3_TARGET_CUSTOMER, D3_FILLER_CUSTOMER = 1, 2
D3_MLX_CUSTOMERS = 100  # mlx_lm.server's cold prompts: customers 100, 101, ... (no two share a history)

# Part a: ~300 tokens of system prompt (SmolLM2 tokenizer), then short user turns.
SYSTEM_PROMPT_A = (
    "You are Quill, the customer assistant of Larkspur Books, an independent bookshop with two stores and an online "
    "catalogue. Answer in one or two short sentences, in plain English, and never invent facts about orders, prices "
    "or stock. Opening hours: the Market Street store is open Monday to Saturday from 9:00 to 19:00 and Sunday from "
    "11:00 to 17:00; the Harbour Road store is open every day from 10:00 to 18:00. Orders placed online before 14:00 "
    "ship the same working day; standard delivery takes two to four working days and is free above 30 euros, "
    "otherwise it costs 3.90 euros. Express delivery costs 7.50 euros and arrives the next working day. Returns are "
    "accepted within 30 days with the receipt, in the original condition; gift cards and special orders cannot be "
    "returned. Members of the Larkspur Reading Club get 10 percent off every purchase, early invitations to author "
    "evenings and one free coffee a month in the Market Street cafe. Special orders for books that are not in stock "
    "usually arrive within five to ten working days, and the customer is called as soon as the book is in. When a "
    "question is about something you do not know, say so politely and suggest calling the store at 555 0142 or "
    "writing to help@larkspur.example. Be warm but brief and do not use lists or headings."
)
USER_MESSAGES_A = (
    "Hello! Are you open on Sunday?",
    "Which store is closer to the harbour?",
    "How long does standard delivery take?",
    "Is delivery free for a 25 euro order?",
    "Can I return a gift card?",
    "What do Reading Club members get?",
    "How long does a special order take?",
    "Can I get express delivery tomorrow?",
    "What is your phone number?",
    "Thanks, that is all for today.",
)

# Part b: a system prompt of its own per conversation (a header naming the customer, so the conversations share no
# prefix worth reusing, then the shop's handbook cut to `--b-system-tokens`), short questions.
HANDBOOK_B = (
    "Follow these rules in every answer: be brief and friendly, answer in one sentence when you can, never make up "
    "order numbers, prices or delivery dates, ask one clarifying question when the request is unclear, and offer "
    "to hand the conversation to a human colleague when the customer is unhappy or asks for one. Keep a calm tone. "
    "Orders: an order can be changed or cancelled free of charge until it has been handed to the carrier, which "
    "usually happens within four working hours of payment; after that the customer has to wait for the parcel and "
    "return it. Every confirmation email carries the order number, the items, the delivery address and a link to "
    "the order page, where the customer can follow each step. If the customer cannot find the email, suggest "
    "looking in the spam folder and then offer to resend it to the address on the account, never to a new one. "
    "Delivery: standard delivery takes two to four working days and is free above 40 euros, otherwise it costs "
    "4.50 euros; express delivery costs 9 euros and arrives the next working day when ordered before 13:00. "
    "Parcels to islands and to addresses outside the mainland take two days longer. The carrier tries twice, then "
    "leaves the parcel at the nearest pickup point for ten days, after which it comes back to the warehouse and the "
    "order is refunded minus the delivery costs. A delivery address can be changed until the parcel is handed to "
    "the carrier; after that only the carrier can redirect it, through the link in its tracking email. "
    "Tracking: the tracking link arrives by email as soon as the carrier scans the parcel, usually the same "
    "evening. A parcel that has shown no movement for three working days is treated as delayed: apologise, open a "
    "carrier inquiry, and tell the customer they will hear from us within two working days. A parcel that shows as "
    "delivered but has not arrived must be reported within seven days; ask the customer to check with neighbours "
    "and the building's letterboxes first, then open a claim. Never promise a delivery date the carrier has not "
    "confirmed. "
    "Returns: items can be returned within 30 days of delivery in their original condition with all labels "
    "attached; underwear, swimwear, earrings, gift cards and made-to-measure items cannot be returned for hygiene "
    "or practical reasons. The return label is free for members and costs 3.90 euros for everybody else. Refunds go "
    "back to the original means of payment within five working days after the warehouse receives the return; bank "
    "transfers can take two more days. Exchanges are handled as a return plus a new order, so suggest placing the "
    "new order at once if the size or colour is in stock. "
    "Products and stock: the product page shows the stock of every size and colour, updated every fifteen minutes. "
    "When an item is sold out the customer can ask for an email when it is back; we cannot reserve items or "
    "promise restock dates. Colours on screens differ slightly from the real fabric, so describe colours with the "
    "words used on the product page. Care instructions are on the label and on the product page; recommend washing "
    "dark colours inside out and at 30 degrees. "
    "Payments: we accept cards, PayPal, Apple Pay, Google Pay, gift cards and, for orders above 100 euros, bank "
    "transfer in advance; the order ships once the transfer arrives, which takes one to three working days. Cash on "
    "delivery is not available. If a payment failed, the order is kept for 48 hours so the customer can pay again "
    "from the order page. Never ask for full card numbers, security codes or passwords, and never accept them if a "
    "customer types them: ask them to delete the message. "
    "Accounts: a password is reset from the sign-in page with the link 'Forgot your password?'; the link is valid for "
    "one hour. We cannot see or send passwords. An email address can be changed in the account settings after "
    "confirming the old one. Accounts are deleted on request within 30 days; orders are kept for seven years "
    "because the law requires it. "
    "Discounts: students get 10 percent off with a valid student card verified once a year through our partner "
    "site; members collect one point per euro and get a 5 euro voucher for every 100 points. Only one discount code "
    "can be used per order, codes cannot be applied after the order is placed, and vouchers cannot be exchanged for "
    "cash. During sales, the price shown at checkout is the price paid; we do not refund differences when prices "
    "drop later. "
    "Complaints: listen first, apologise for the trouble without blaming the carrier or colleagues, and say exactly "
    "what happens next and when. Offer a human colleague whenever the customer asks, is upset, or the request needs "
    "an exception to these rules, for example a return after 30 days, a refund to a different account, or a "
    "compensation. Colleagues answer between 8:00 and 20:00 on working days, usually within one hour. "
    "Privacy: only discuss an order with the person whose account it belongs to; ask for the order number and the "
    "email address on the order before giving any detail. Never read out a full address or phone number; confirm "
    "only the town. Do not store or repeat personal details that the customer did not need to give. "
    "Style: write plain sentences without lists, headings or emojis, use the customer's words, avoid jargon, and "
    "end with a short question only when you need an answer to go on."
)
QUESTIONS_B = (
    "Where is my parcel?",
    "Can I change the delivery address?",
    "Do you have this in blue?",
    "How do I reset my password?",
    "Is there a discount for students?",
    "Can I pay by bank transfer?",
)


D3_EXCHANGES = (
    (
        "Hello, I ordered a rain jacket last week and it has still not arrived.",
        "I am sorry it is late; could you give me the order number and the email address on the order?",
    ),
    (
        "The order number is 58213 and the email is the one on my account.",
        "Thank you; the parcel left our warehouse on Tuesday and the carrier shows it at your local depot.",
    ),
    (
        "Can I still have it delivered to my office instead of my home?",
        "The parcel is with the carrier already, so only the carrier can redirect it, through its tracking email.",
    ),
)
D3_QUESTION = "If that does not work, can I return it and order it again in another size?"


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One streamed chat completion of a conversation; `conversation` and `turn` count from 1."""

    conversation: int
    turn: int
    reply: Streamed

    @property
    def prompt_tokens(self) -> int:
        return self.reply.prompt_tokens or 0

    @property
    def cached_tokens(self) -> int | None:
        return self.reply.cached_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationRun:
    """Part a: one server's conversation."""

    server: ServerRecord
    turns: list[Turn]
    stats: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """Part b or d1: K conversations interleaved on one server process (`budget_bytes`: at the equal budget, or
    d1's memory budget; `disk_bytes`: Courier's disk tier in d1)."""

    model: str
    budget: str
    conversations: int
    server: ServerRecord
    turns: list[Turn]
    stats: dict[str, Any] | None  # Courier's /v1/cache/stats after the last turn (once idle, in d1)
    budget_bytes: int | None = None
    disk_bytes: int | None = None
    wall_s: float | None = None  # d1: the server process, from its start to its exit


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteBudget:
    """A byte budget for one model, and where it came from."""

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


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    conversation: list[ConversationRun] = field(default_factory=list)
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


# ---------------------------------------------------------------- turns and servers


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


async def ask(
    client: openai.AsyncOpenAI,
    model: str,
    messages: Messages,
    max_tokens: int,
    *,
    user_id: str | None = None,
    at: tuple[int, int] = (1, 1),
) -> Turn:
    """Turn `at` (conversation, turn) streamed at temperature 0 as `user_id`; TTFT runs to the first content delta."""
    reply = await stream_chat(client, model, messages, max_tokens=max_tokens, user=user_id or openai.omit)
    if reply.prompt_tokens is None:
        raise BenchmarkError(f"conversation {at[0]} turn {at[1]}: the stream carried no usage")
    return Turn(conversation=at[0], turn=at[1], reply=reply)


async def warm_up(client: openai.AsyncOpenAI, model: str) -> None:
    await ask(client, model, user(WARMUP_PROMPT), 8, user_id=WARM_UP_USER, at=(0, 0))


def courier_stats(server: Server) -> dict[str, Any]:
    with httpx.Client(timeout=30.0) as http:
        response = http.get(f"{server.base_url}/v1/cache/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


def reset_cache(server: Server) -> None:
    httpx.post(f"{server.base_url}/v1/cache/reset", timeout=30.0).raise_for_status()


def wait_until_idle(server: Server) -> tuple[dict[str, Any], float]:
    """Poll `/v1/cache/stats` until Courier has nothing left to do for its cache: no warm-up pending, no disk write
    or delete pending, and IDLE_COUNTERS unchanged since the previous poll. The last stats and the seconds."""
    started = time.monotonic()
    previous: tuple[Any, ...] | None = None
    while True:
        stats = courier_stats(server)
        counters = tuple(stats.get(key) for key in IDLE_COUNTERS)
        idle = stats.get("snapshot_warmups_pending", 0) == 0 and stats.get("snapshot_disk_pending", 0) == 0
        if idle and counters == previous:
            return stats, time.monotonic() - started
        if time.monotonic() - started > IDLE_TIMEOUT_S:
            raise BenchmarkError(f"Courier not idle after {IDLE_TIMEOUT_S:.0f} s: {stats}")
        previous = counters if idle else None
        time.sleep(IDLE_POLL_S)


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise BenchmarkError(f"{what}: stopped after the --run-timeout")


def later(turns: Sequence[Turn]) -> list[Turn]:
    return [turn for turn in turns if turn.turn >= 2]


def cached_share(turns: Sequence[Turn]) -> float | None:
    """Of turns 2+: sum cached / sum prompt tokens."""
    if not (chosen := later(turns)) or any(turn.cached_tokens is None for turn in chosen):
        return None
    return share(sum(turn.cached_tokens or 0 for turn in chosen), sum(turn.prompt_tokens for turn in chosen))


def warm_share(turns: Sequence[Turn]) -> float | None:
    """The share of turns 2+ served from the state the conversation's previous turn left: at least its whole
    previous prompt but the generation prompt came from the cache (a system prompt alone does not count)."""
    previous: dict[int, Turn] = {}
    warm = counted = 0
    for turn in sorted(turns, key=lambda item: (item.conversation, item.turn)):
        before, previous[turn.conversation] = previous.get(turn.conversation), turn
        if before is not None and turn.cached_tokens is not None:
            counted += 1
            warm += turn.cached_tokens >= before.prompt_tokens - GENERATION_PROMPT_TOKENS
    return share(warm, counted)


def ttft_p50(turns: Sequence[Turn]) -> float | None:
    return median_or_none([turn.reply.ttft_s for turn in turns])


def run_cells(run: Run) -> str:
    """cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ | TTFT p50 ms, turn 1 | empty replies"""
    share_text = "FAILED" if run.server.error is not None else percent(cached_share(run.turns))
    first = [turn for turn in run.turns if turn.turn == 1]
    empty = sum(not turn.reply.content_deltas for turn in run.turns)
    later_p50, first_p50 = ms(ttft_p50(later(run.turns))), ms(ttft_p50(first))
    return f"{share_text} | {percent(warm_share(run.turns))} | {later_p50} | {first_p50} | {empty}"


def shares_text(turns: Sequence[Turn]) -> str:
    return f"cached share {percent(cached_share(turns))}, warm turns {percent(warm_share(turns))}"


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
            turns = asyncio.run(converse(server, args))
            return turns, courier_stats(server) if server.spec.is_courier else None

        record, result = launcher.run(chosen, measure, log_name=f"a-{label}")
        turns, stats = result or ([], None)
        report.conversation.append(ConversationRun(server=record, turns=turns, stats=stats))


# ---------------------------------------------------------------- part b: K interleaved conversations


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


def prepare_b(
    model: str,
    cache_dir: Path,
    dir4: Path,
    args: argparse.Namespace,
    *,
    states: int,
    turns: int,
    fixed: int | None,
    flag: str,
) -> TinyWorkload:
    """The handbook text for `--b-system-tokens`, and a byte budget: `states` model states of a conversation at its
    last prompt (after `turns` turns, its replies stood in for by one-token words), weighed in this process on
    mlx-lm's own cache (or `fixed`, given by `flag`)."""
    from mlx_lm import load

    model_dir = tiny_model(model, dir4, cache_dir)
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
    release_mlx_memory()
    workload = (
        f"system prompt {system} tokens, last prompt of a conversation about {len(last)} tokens, one model state "
        f"there {one_state} B (mlx-lm cache contents)"
    )
    if fixed is not None:
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
        turns.append(
            await ask(
                client, model, messages, max_tokens, user_id=f"k{k}-conversation-{index + 1}", at=(index + 1, turn + 1)
            )
        )
        messages.append({"role": "assistant", "content": turns[-1].reply.text})
    return turns


async def interleave(
    server: Server, k: int, handbook: str, args: argparse.Namespace, *, turns: int, settle: bool = False
) -> list[Turn]:
    """K fresh conversations, `turns` turns each, interleaved turn by turn, after a warm-up request (and, on Courier,
    a cache reset that forgets it; with `settle` only once Courier is idle, or the warm-up's own idle warm-up may
    land after the reset)."""
    deadline = time.monotonic() + args.run_timeout
    histories, results = histories_b(k, handbook), []
    async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
        await warm_up(client, server.spec.model)
        if server.spec.is_courier:
            if settle:
                wait_until_idle(server)
            reset_cache(server)
        for turn in range(turns):
            check_deadline(deadline, f"{server.spec.name} K={k}")
            results += await interleaved_round(
                client, server.spec.model, histories, turn, k=k, max_tokens=args.b_max_tokens
            )
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
        tiny = prepare_b(
            model,
            launcher.cache_dir,
            dir4,
            args,
            states=args.budget_states,
            turns=args.b_turns,
            fixed=args.budget_bytes,
            flag="--budget-bytes",
        )
        budget = tiny.budget.capacity_bytes
        progress(f"tiny {model} model: {tiny.model_dir}; equal byte budget {budget} B ({tiny.budget.explanation})")
        if EQUAL_BUDGET in args.b_budgets:
            report.budgets.append(tiny.budget)
        for name, label, k in part_b_plan(args):

            def measure(server: Server, k: int = k, handbook: str = tiny.handbook) -> tuple[list[Turn], Any]:
                turns = asyncio.run(interleave(server, k, handbook, args, turns=args.b_turns))
                return turns, courier_stats(server) if server.spec.is_courier else None

            log_name = f"b-{model}-{label}-{name}-k{k}"
            record, result = launcher.run(
                part_b_spec(label, tiny.model_dir, name, budget, args), measure, log_name=log_name
            )
            turns, stats = result or ([], None)
            equal = budget if name == EQUAL_BUDGET else None
            report.interleaved.append(
                Run(
                    model=model,
                    budget=name,
                    conversations=k,
                    server=record,
                    turns=turns,
                    stats=stats,
                    budget_bytes=equal,
                )
            )
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


# ---------------------------------------------------------------- part c: store latency


def make_store_workload(
    args: argparse.Namespace,
) -> tuple[list[tuple[int, ...]], list[str], dict[str, list[tuple[str, tuple[int, ...], int]]]]:
    """The vectors, their sessions, and per kind the lookups (session, tokens, least matched; 0: a miss), all made
    before anything is timed."""
    rng = random.Random(args.seed)
    vocab = list(range(STORE_VOCAB))  # shared int objects keep the vectors' memory at a pointer per token
    prefix = tuple(rng.choices(vocab, k=STORE_PREFIX_TOKENS))
    low, high = STORE_SUFFIX_TOKENS
    vectors = [prefix + tuple(rng.choices(vocab, k=rng.randint(low, high))) for _ in range(args.store_entries)]
    names = [f"user-{index % args.store_sessions}" for index in range(args.store_entries)]
    next_turns = []
    for _ in range(args.store_lookups):
        index = rng.randrange(args.store_entries)
        next_turns.append(
            (names[index], vectors[index] + tuple(rng.choices(vocab, k=STORE_NEXT_TURN_TOKENS)), len(vectors[index]))
        )
    shared = [
        (f"new-{index}", prefix + tuple(rng.choices(vocab, k=STORE_NEW_CONVERSATION_TOKENS)), STORE_PREFIX_TOKENS)
        for index in range(args.store_lookups)
    ]
    others = [token for token in vocab if token != prefix[0]]
    misses = [
        (f"new-{index}", (rng.choice(others), *rng.choices(vocab, k=STORE_MISS_TOKENS - 1)), 0)
        for index in range(args.store_lookups)
    ]
    return vectors, names, {LOOKUP_NEXT_TURN: next_turns, LOOKUP_SHARED_PREFIX: shared, LOOKUP_MISS: misses}


def latency(operation: str, samples_ns: Sequence[int], unexpected: int) -> dict[str, Any]:
    micros = [sample / 1000 for sample in samples_ns]
    return {
        **{"operation": operation, "count": len(micros)},
        **{"p50_us": percentile(micros, 0.50), "p99_us": percentile(micros, 0.99), "max_us": max(micros)},
        "unexpected": unexpected,  # lookups whose outcome was not the kind's (a hit that missed, ...)
    }


def measure_store(args: argparse.Namespace) -> dict[str, Any]:
    """Inserts one by one, then each kind's lookups, in microseconds; the entries and the seconds to build them."""
    from courier.core.prompt_cache.entries import Bucket, Origin
    from courier.core.prompt_cache.stats import StoreLimits
    from courier.core.prompt_cache.store import SnapshotStore

    progress(f"store: making {args.store_entries} vectors and {args.store_lookups} lookups of each kind")
    vectors, sessions, lookups = make_store_workload(args)
    limits = StoreLimits(
        capacity_bytes=1 << 62, max_entries=2 * args.store_entries, ttl_s=1e9, min_prefix=STORE_MIN_PREFIX
    )
    store = SnapshotStore(limits, trimmable=True, clock=time.monotonic)
    bucket = Bucket("m")
    gc.collect()
    insert_ns: list[int] = []
    build_started = time.perf_counter()
    for session, tokens in zip(sessions, vectors, strict=True):
        started = time.perf_counter_ns()
        store.insert(bucket=bucket, session=session, origin=Origin.COMPLETION, tokens=tokens, state=None, nbytes=1)
        insert_ns.append(time.perf_counter_ns() - started)
    build_s = time.perf_counter() - build_started
    progress(f"store: {store.entries} entries inserted in {build_s:.1f} s; timing lookups")
    operations = [latency(f"insert (store growing to {store.entries})", insert_ns, 0)]
    for kind, queries in lookups.items():
        samples: list[int] = []
        unexpected = 0
        for session, tokens, expected in queries:
            started = time.perf_counter_ns()
            result = store.lookup(bucket, session, tokens)
            samples.append(time.perf_counter_ns() - started)
            # A hit must reach at least its expected length (a new suffix may match a stored token by chance).
            unexpected += result.matched < expected if expected else result.matched != 0
        operations.append(latency(kind, samples, unexpected))
    return {"entries": store.entries, "sessions": args.store_sessions, "build_s": build_s, "operations": operations}


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
    flags = (
        "--prompt-cache-snapshot-capacity-bytes",
        str(budget_bytes),
        "--prompt-cache-disk-bytes",
        str(args.d_disk_bytes),
    )
    return spec(label, model_dir, *args.courier_arg, *flags, "--prompt-cache-dir", str(prompt_dir))


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
        turns = asyncio.run(interleave(server, k, tiny.handbook, args, turns=args.d_turns, settle=True))
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
    return Run(
        model=tiny.model,
        budget="d1",
        conversations=k,
        server=record,
        turns=turns,
        stats=stats,
        budget_bytes=tiny.budget.capacity_bytes,
        disk_bytes=args.d_disk_bytes if is_courier(label) else None,
        wall_s=wall_s,
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

    async def turns(server: Server, start: int, count: int, reset: bool) -> list[Turn]:
        deadline, done = time.monotonic() + args.run_timeout, []
        async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
            await warm_up(client, server.spec.model)
            if courier and reset:
                wait_until_idle(server)
                reset_cache(server)
            for turn in range(start, start + count):
                check_deadline(deadline, log_name)
                done += await interleaved_round(
                    client, server.spec.model, histories, turn, k=k, max_tokens=args.b_max_tokens
                )
        return done

    def before(server: Server) -> tuple[list[Turn], float | None, dict[str, Any] | None]:
        done = asyncio.run(turns(server, 0, args.d_turns, reset=True))
        if not courier:
            return done, None, None
        if stop == signal.SIGKILL:
            stats, idle_s = wait_until_idle(server)
            return done, idle_s, stats
        return done, None, courier_stats(server)

    def after(server: Server) -> tuple[list[Turn], dict[str, Any] | None, dict[str, Any] | None]:
        at_start = courier_stats(server) if courier else None
        done = asyncio.run(turns(server, args.d_turns, 1, reset=False))
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
    progress(
        f"{log_name}: next turns after the restart: cached share {percent(cached_share(turns_after))}, "
        f"adopted {adopted}"
    )
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


def courier_ttft(launcher: Launcher, target: Messages, filler: Messages, args: argparse.Namespace) -> DiskTtft:
    """d3 on Courier: a memory-only Courier first weighs the conversation's snapshot at rest (unless
    --d-ttft-capacity-bytes); then per repeat, reset, the target prompt cold; the filler conversation cold (its
    snapshots push the target's out of memory); the target again (a disk hit); and once more (a memory hit). Courier
    is idle before every timed request and before every reset."""
    probe, entry, capacity = None, None, args.d_ttft_capacity_bytes

    async def once(server: Server, messages: Messages, user_id: str) -> Turn:
        async with async_client(server.base_url, REQUEST_TIMEOUT_S) as client:
            return await ask(client, server.spec.model, messages, args.d_ttft_max_tokens, user_id=user_id)

    if capacity is None:

        def weigh(server: Server) -> dict[str, Any]:
            asyncio.run(once(server, user(WARMUP_PROMPT), WARM_UP_USER))
            wait_until_idle(server)
            reset_cache(server)
            asyncio.run(once(server, target, D3_TARGET_USER))
            stats, _ = wait_until_idle(server)
            progress(
                f"d3 probe: {stats.get('snapshot_entries')} entries, {stats.get('snapshot_bytes_per_entry')} B an entry"
            )
            return stats

        probe, stats = launcher.run(
            spec(COURIER, None, *args.courier_arg, "--prompt-cache-disk-bytes", "0"), weigh, log_name="d3-courier-probe"
        )
        if not (entry := int(stats.get("snapshot_bytes_per_entry", 0)) if stats else None):
            failed = ServerRecord(
                name=COURIER,
                command=[],
                extra_env={},
                log_path="",
                error=f"probe failed: {probe.error or 'no snapshot held'}",
            )
            return DiskTtft(server=failed, probe=probe, entry_bytes=entry)
        capacity = int(entry * D3_CAPACITY_ENTRIES)
    prompt_dir = fresh_prompt_dir(launcher.cache_dir, "d3-courier")

    def measure(server: Server) -> tuple[list[TtftSample], dict[str, Any]]:
        deadline, samples = time.monotonic() + args.run_timeout, []
        asyncio.run(once(server, user(WARMUP_PROMPT), WARM_UP_USER))
        for repeat in range(args.d_ttft_repeats):
            check_deadline(deadline, "d3 courier")
            wait_until_idle(server)
            reset_cache(server)
            for kind, messages, user_id in (
                (COLD, target, D3_TARGET_USER),
                (FILLER, filler, D3_FILLER_USER),
                (DISK_HIT, target, D3_TARGET_USER),
                (MEMORY_HIT, target, D3_TARGET_USER),
            ):
                before, _ = wait_until_idle(server)
                turn = asyncio.run(once(server, messages, user_id))
                samples.append(ttft_sample(kind, repeat, turn, before, courier_stats(server)))
                progress(
                    f"d3 courier #{repeat + 1} {kind}: TTFT {ms(samples[-1].ttft_s)} ms, cached {turn.cached_tokens}, "
                    f"{samples[-1].gained}, verified {samples[-1].verified}"
                )
        return samples, courier_stats(server)

    try:
        record, result = launcher.run(
            disk_spec(COURIER, None, capacity, prompt_dir, args), measure, log_name="d3-courier"
        )
    finally:
        shutil.rmtree(prompt_dir, ignore_errors=True)
    samples, stats = result or ([], None)
    return DiskTtft(
        server=record, probe=probe, entry_bytes=entry, capacity_bytes=capacity, samples=samples, stats=stats
    )


def mlx_ttft(launcher: Launcher, dir4: Path, words: str, args: argparse.Namespace) -> DiskTtft:
    """d3's context on mlx_lm.server (float32 SmolLM2, as part a): per repeat, a prompt like Courier's but for
    another customer (cold: nothing but a few template tokens is cached), then the same prompt again (a memory hit).
    It has no disk tier."""
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
        tiny = prepare_b(
            model,
            launcher.cache_dir,
            dir4,
            args,
            states=args.d_budget_conversations,
            turns=args.d_turns,
            fixed=args.d_budget_bytes,
            flag="--d-budget-bytes",
        )
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


# ---------------------------------------------------------------- report


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


def ratio_text(ours: float | None, theirs: float | None, show: Callable[[float | None], str]) -> str:
    """Both figures and their ratio, as in "97.1% / 97.0% = 1.001x"."""
    return f"{show(ours)} / {show(theirs)} = {'n/a' if ours is None or not theirs else f'{ours / theirs:.3f}x'}"


def baseline_line(where: str, ours: Sequence[Turn], theirs: Sequence[Turn]) -> str:
    """courier / courier-baseline: cached share (above 1 favours courier) and TTFT p50 (below 1 does) of turns 2+."""
    shares = ratio_text(cached_share(ours), cached_share(theirs), percent)
    ttfts = ratio_text(ttft_p50(later(ours)), ttft_p50(later(theirs)), ms)
    return f"- courier / courier-baseline{where}: cached share, turns 2+ {shares}; TTFT p50 ms, turns 2+ {ttfts}"


def print_part_a(runs: Sequence[ConversationRun]) -> None:
    print("### (a) One conversation, ~300-token system prompt, SmolLM2-135M-Instruct\n")
    print_launches([run.server for run in runs])

    def cells(run: ConversationRun, number: int) -> str:
        turn = next((item for item in run.turns if item.turn == number), None)
        return " |  | " if turn is None else f"{ms(turn.reply.ttft_s)} | {turn.prompt_tokens} | {turn.cached_tokens}"

    rows = [
        f"{n} | " + " | ".join(cells(run, n) for run in runs) for n in range(1, 1 + max(len(r.turns) for r in runs))
    ]
    rows.append(
        "p50 / share, turns 2+ | "
        + " | ".join(f"{ms(ttft_p50(later(r.turns)))} | | {percent(cached_share(r.turns))}" for r in runs)
    )
    table("turn | " + " | ".join(f"{run.server.name} TTFT ms | prompt | cached" for run in runs), rows)
    named = {run.server.name: run for run in runs}
    if COURIER in named and COURIER_BASELINE in named:
        print(baseline_line("", named[COURIER].turns, named[COURIER_BASELINE].turns))
    keys = ("snapshot_entries", "snapshot_hits", "snapshot_lookups", "snapshot_supersedes", "tokens_reused")
    for run in runs:
        if run.stats is not None:
            print(f"- {run.server.name} cache stats: " + ", ".join(f"{key} {run.stats.get(key)}" for key in keys))
    print()


def budget_label(run: Run) -> str:
    if run.budget == EQUAL_BUDGET:
        return f"equal ({run.budget_bytes} B)"
    return f"--prompt-cache-size {ANCHOR_CACHE_SIZE}" if run.budget == ANCHOR_BUDGET else run.budget


def stat_cells(stats: dict[str, Any] | None, keys: Sequence[str], missing: str = "-") -> str:
    if stats is None:
        return " | ".join(missing for _ in keys)
    return " | ".join(f"{v:.2f}" if isinstance(v := stats.get(key, "?"), float) else str(v) for key in keys)


def print_part_b(runs: Sequence[Run], budgets: Sequence[ByteBudget], args: argparse.Namespace) -> None:
    print("### (b) K interleaved conversations, tiny models\n")
    print_launches([run.server for run in runs])
    for budget in budgets:
        print(f"- equal budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print()
    order = {name: index for index, name in enumerate(B_BUDGETS)}
    table(
        "model | budget | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ "
        "| TTFT p50 ms, turn 1 | empty replies | courier entries | evictions_lru | self_evictions",
        (
            f"{run.model} | {budget_label(run)} | {run.conversations} | {run.server.name} | {run_cells(run)} "
            f"| {stat_cells(run.stats, ('snapshot_entries', 'snapshot_evictions_lru', 'snapshot_self_evictions'))}"
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
    if EQUAL_BUDGET not in args.b_budgets:
        return
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
            count = ratio_text(mine, held[model, COURIER_BASELINE][2], lambda n: "n/a" if n is None else f"{n:.0f}")
            print(f"- {model}: courier / courier-baseline = {count}")
        for label in (label for label in QUANTIZED_COURIERS if (model, label) in held):
            quantized = held[model, label][2]
            print(
                f"- {model}: {label} / courier = {ratio_text(quantized, mine, count_text)}, {label} / mlx_lm.server "
                f"= {ratio_text(quantized, peer, count_text)} (goals: 8-bit >= 1.9x, 4-bit >= 3.5x courier's count)"
            )
    print()


def print_part_c(store: dict[str, Any]) -> None:
    low, high = STORE_SUFFIX_TOKENS
    print(f"### (c) Snapshot store latency, {store['entries']} entries in process\n")
    print(
        f"- vectors: a {STORE_PREFIX_TOKENS}-token shared prefix + {low}-{high} random tokens, "
        f"{store['sessions']} sessions; built in {store['build_s']:.1f} s\n"
    )
    table(
        "operation | count | p50 us | p99 us | max us | unexpected outcomes",
        (
            f"{op['operation']} | {op['count']} | {op['p50_us']:.1f} | {op['p99_us']:.1f} | {op['max_us']:.1f} "
            f"| {op['unexpected']}"
            for op in store["operations"]
        ),
    )
    worst = max(
        (op["p99_us"] for op in store["operations"] if op["operation"].startswith("lookup")), default=float("nan")
    )
    verdict = "meets" if worst < STORE_LOOKUP_TARGET_US else "misses"
    print(f"- worst lookup p99 {worst:.1f} us: {verdict} the target (< {STORE_LOOKUP_TARGET_US:.0f} us)\n")


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
    for run in report.disk_runs:
        share_text = percent(cached_share(run.turns))
        if run.conversations == top and is_courier(run.server.name):
            print(
                f"- target, >= {D_TARGET_SHARE:.0%} of turns-2+ prompt tokens cached at K={top}, {run.model}: "
                f"{run.server.name} {share_text}, {met(cached_share(run.turns), D_TARGET_SHARE)}"
            )
        elif run.conversations == top:
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

    def verified(item: DiskTtft, kind: str) -> list[float]:
        return [sample.ttft_s for sample in item.samples if sample.kind == kind and sample.verified]

    def gained(samples: Sequence[TtftSample], key: str) -> str:
        return str(sum(sample.gained[key] for sample in samples)) if samples and samples[0].gained else "-"

    rows = []
    for item in report.ttft:
        for kind in D3_KINDS:
            if samples := [sample for sample in item.samples if sample.kind == kind]:
                ttfts = verified(item, kind)
                rows.append(
                    f"{item.server.name} | {kind} | {len(ttfts)}/{len(samples)} | {ms(median_or_none(ttfts))} "
                    f"| {ms(min(ttfts) if ttfts else None)} | {ms(max(ttfts) if ttfts else None)} "
                    f"| {samples[0].prompt_tokens} "
                    f"| {statistics.median(sample.cached_tokens or 0 for sample in samples):.0f} "
                    f"| {' | '.join(gained(samples, key) for key in GAINED_SHOWN)}"
                )
    table(
        "server | measure | verified | TTFT p50 ms | min ms | max ms | prompt tokens | cached tokens, median "
        "| disk hits gained | memory hits gained | lookups timed out",
        rows,
    )
    for item in report.ttft:
        if item.server.error is not None:
            print(f"- {item.server.name} FAILED: {item.server.error.splitlines()[0]}")
        cold = median_or_none(verified(item, COLD))
        if not is_courier(item.server.name):
            print(f"- {item.server.name}: cold TTFT p50 {ms(cold)} ms (no disk tier)")
            continue
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
        print("### (d) The disk tier\n")
        records = report.records()
        print_launches(records[len(report.conversation) + len(report.interleaved) :])
        for budget in report.disk_budgets:
            print(f"- memory budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
        print("- wall time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in report.wall_s.items()) + "\n")
        if report.disk_runs:
            print_part_d1(report, args)
        if report.restarts:
            print_part_d2(report)
        if report.ttft:
            print_part_d3(report)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(DEFAULT_PARTS), help="parts to run (a,b,c; d when asked for)")
    add("--run-timeout", type=float, default=900.0, help="seconds of measuring one server run may take (900)")
    add("--courier-arg", action="append", default=[], help="a flag for every Courier, as --courier-arg=--flag=value")
    a = parser.add_argument_group("part a: one conversation on SmolLM2")
    a.add_argument("--turns", type=int, default=10, help="turns of the conversation (10)")
    a.add_argument("--a-max-tokens", type=int, default=24, help="max_tokens per turn (24)")
    a.add_argument(
        "--a-servers", type=cli.names((*A_SERVERS, COURIER_BASELINE)), default=None, help=f"{','.join(A_SERVERS)}"
    )
    b = parser.add_argument_group("part b: K interleaved conversations on tiny models")
    b.add_argument("--conversations", type=cli.positive_ints, default=[2, 8, 32], help="K values (2,8,32)")
    b.add_argument("--b-turns", type=int, default=4, help="turns per conversation (4)")
    b.add_argument(
        "--b-max-tokens", type=int, default=DEFAULT_MAX_TOKENS_B, help=f"max_tokens per turn ({DEFAULT_MAX_TOKENS_B})"
    )
    b.add_argument(
        "--b-models",
        type=cli.names((*TINY_MODELS, *WIDE_TINY_MODELS)),
        default=list(TINY_MODELS),
        help="llama,qwen3_next (-wide: 64-dimension heads, for courier-8bit and courier-4bit)",
    )
    b.add_argument("--b-servers", type=cli.names(B_SERVERS), default=None, help=f"{','.join(B_SERVERS)}")
    b.add_argument(
        "--b-system-tokens", type=int, default=DEFAULT_SYSTEM_TOKENS_B, help="tokens of each system prompt (550)"
    )
    b.add_argument("--b-budgets", type=cli.names(B_BUDGETS), default=list(B_BUDGETS), help=f"{','.join(B_BUDGETS)}")
    b.add_argument(
        "--equal-conversations",
        type=cli.positive_ints,
        default=EQUAL_CONVERSATIONS,
        help="K at the equal budget (4-16,20,24)",
    )
    b.add_argument(
        "--budget-states", type=int, default=BUDGET_STATES, help=f"equal budget in model states ({BUDGET_STATES})"
    )
    b.add_argument("--budget-bytes", type=int, default=None, help="the equal byte budget itself (default: derived)")
    c = parser.add_argument_group("part c: the snapshot store in process")
    c.add_argument("--store-entries", type=int, default=10_000, help="entries in the store (10000)")
    c.add_argument("--store-sessions", type=int, default=1000, help="sessions the entries belong to (1000)")
    c.add_argument("--store-lookups", type=int, default=2000, help="lookups timed per kind (2000)")
    c.add_argument("--seed", type=int, default=0, help="random seed (0)")
    d = parser.add_argument_group("part d: the disk tier")
    d.add_argument("--d-sections", type=cli.names(D_SECTIONS), default=list(D_SECTIONS), help="sections (1,2,3)")
    d.add_argument(
        "--d-models",
        type=cli.names((*TINY_MODELS, *WIDE_TINY_MODELS)),
        default=list(TINY_MODELS),
        help="d1, d2 models (llama,qwen3_next; -wide for courier-8bit and courier-4bit)",
    )
    d.add_argument(
        "--d-servers", type=cli.names(D_SERVERS), default=list(D_DEFAULT_SERVERS), help=f"{','.join(D_SERVERS)}"
    )
    d.add_argument("--d-conversations", type=cli.positive_ints, default=D_CONVERSATIONS, help="d1: K values (8,32,128)")
    d.add_argument("--d-turns", type=int, default=D_TURNS, help=f"d1, d2: turns per conversation ({D_TURNS})")
    d.add_argument(
        "--d-budget-conversations", type=int, default=D_BUDGET_CONVERSATIONS, help="d1, d2: memory budget in states (8)"
    )
    d.add_argument(
        "--d-budget-bytes", type=int, default=None, help="d1, d2: the memory budget itself (default: derived)"
    )
    d.add_argument(
        "--d-disk-bytes", type=int, default=D_DISK_BYTES, help=f"Courier's --prompt-cache-disk-bytes ({D_DISK_BYTES})"
    )
    d.add_argument("--d-restart-conversations", type=int, default=D_RESTART_CONVERSATIONS, help="d2: K (32)")
    d.add_argument(
        "--d-restart-signals", type=cli.names(tuple(D_STOP_SIGNALS)), default=list(D_STOP_SIGNALS), help="d2: term,kill"
    )
    d.add_argument("--d-ttft-repeats", type=int, default=D_TTFT_REPEATS, help=f"d3: repeats ({D_TTFT_REPEATS})")
    d.add_argument(
        "--d-history-tokens", type=int, default=D_HISTORY_TOKENS, help=f"d3: prompt tokens ({D_HISTORY_TOKENS})"
    )
    d.add_argument(
        "--d-ttft-max-tokens", type=int, default=D_TTFT_MAX_TOKENS, help=f"d3: max_tokens ({D_TTFT_MAX_TOKENS})"
    )
    d.add_argument(
        "--d-ttft-capacity-bytes", type=int, default=None, help="d3: Courier's memory budget (default: measured)"
    )
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
    settings = {
        key: value for key, value in vars(args).items() if key not in ("cache_dir", "json", "openblas", "run_timeout")
    }
    settings |= {
        "d_restart_signals": [stop.name for stop in args.d_restart_signals],
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
    }
    report = Report(environment=environment(blas), settings=settings)
    if {"a", "b", "d"} & set(
        args.parts
    ):  # parts a, b and d share the 4-bit SmolLM2 (the tiny models borrow its tokenizer)
        with cache_directory(args.cache_dir) as cache_dir:
            launcher = Launcher(
                bench="multiturn",
                cache_dir=cache_dir,
                log_dir=cache_dir / "bench-logs",
                openblas=args.openblas,
                baseline_tree=args.baseline_tree,
            )
            progress("converting the embedded GGUF to a 4-bit MLX directory")
            dir4 = prepare_4bit_dir(cache_dir)
            for part, run in (("a", run_part_a), ("b", run_part_b), ("d", run_part_d)):
                if part in args.parts:
                    run(launcher, dir4, args, report)
    if "c" in args.parts:
        report.store = measure_store(args)
    print_report(report, args)
    write_json(report, args.json)
    return 1 if any(record.error for record in report.records()) else 0


if __name__ == "__main__":
    sys.exit(main())
