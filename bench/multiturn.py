"""Multi-turn prompt-cache reuse of Courier against mlx_lm.server, side by side, plus the snapshot store's latency.

Three parts, selected with `--parts` (all by default):

a. One conversation on the embedded SmolLM2-135M-Instruct: a ~300-token system prompt, then
   `--turns` (10) short user messages, each sent as a streaming chat completion (`max_tokens`
   24, temperature 0) with the whole history; the assistant's reply is appended to the history
   before the next turn. Per turn: TTFT (request sent .. first content delta), `prompt_tokens`
   and `usage.prompt_tokens_details.cached_tokens`. Servers (`--a-servers`):

   - `courier`: `courier serve --port P --cache-dir C` (embedded model; float32 on OpenBLAS);
   - `mlx-lm-f32`: `LD_PRELOAD=<OpenBLAS> python -m mlx_lm.server --model DIR_F32 --port P
     --log-level WARNING` on the same weights dequantized to float32 (bench.throughput's
     tuned server; its concurrency flags do not matter for one stream);
   - `mlx-lm-4bit`: `python -m mlx_lm.server --model DIR4 --port P`, as shipped;
   - `courier-baseline` (only with `--baseline-tree DIR`, and then by default, right after
     `courier`): see below.

b. K conversations (`--conversations`, 2,8,32) interleaved turn by turn (conversation 1 turn 1,
   conversation 2 turn 1, ..., conversation 1 turn 2, ...), one request at a time, each
   conversation with its own `user` field and system prompt, `--b-turns` (4) turns of
   `max_tokens` 32 (`--b-max-tokens`), on two tiny random-weight models built by
   `tests/support/tiny_models.py`: a dense llama (trimmable KV cache) and a hybrid qwen3_next
   (gated-delta layers; not trimmable). A system prompt is a header naming the customer (so no
   two conversations share a prefix worth reusing) and then a shop's support handbook, cut at
   a word to `--b-system-tokens` (550) tokens in all; a user message is one short question
   ("Message 2: Where is my parcel?", 20 tokens with its chat-template tokens). Per server,
   model, budget and K: the share of turn-2+ prompt tokens served from the cache (sum cached /
   sum prompt over turns >= 2), the share of turns 2+ that were warm (at least the
   conversation's whole previous prompt but its 3-token generation prompt came from the cache;
   a system prompt alone does not count) and TTFT p50 (turns >= 2, and turn 1 apart). Every
   (server, model, budget, K) gets a fresh server process. Budgets (`--b-budgets`):

   - `default`: both servers with their defaults (Courier sizes its store from the model,
     at least 512 MiB; mlx_lm.server keeps 10 caches, `--prompt-cache-size 10`, no byte cap);
   - `size100`: mlx_lm.server with `--prompt-cache-size 100`, the issue's anchor. Up to K=8 it
     evicts nothing here (a conversation leaves at most 1 + 2 x 4 caches on a hybrid model);
   - `equal`: one byte budget B for both, with K swept over `--equal-conversations`
     (4-16, 20, 24). B is `--budget-states` (16) model states of one conversation at its
     last prompt (the system prompt, 4 questions and 3 replies of `--b-max-tokens` one-token
     words: about 730 tokens), weighed in this process on mlx-lm's own cache of the tiny
     model, contents only (a KV cache's 256-token growth buffer not counted). No server's
     footprint sizes it: it is room for 16 conversations for a server that keeps exactly one
     state per conversation. `--budget-bytes` sets B directly. Courier gets
     `--prompt-cache-snapshot-capacity-bytes B`; mlx_lm.server gets `--prompt-cache-bytes B`
     and `--prompt-cache-size 4096` (Courier's default entry cap), so that bytes, not its
     10-entry default, are what binds. Each is charged by its own accounting of what it
     holds: mlx_lm.server counts its KV buffers as allocated, Courier its compact copies.

   Conversations held warm at B, per server and model: the largest swept K up to which the
   server's cached share at B stays >= 80% of its own share with an unconstrained cache at K=8
   (Courier: `default`; mlx_lm.server: `size100`); the ratio Courier / mlx_lm.server is the
   issue's second target (>= 1.5x). With round-robin turns and LRU eviction a share falls off
   a cliff once the conversations stop fitting (the entry evicted is the one asked for next),
   so the threshold only has to tell warm from thrashing. It does not by itself keep out a
   fallback to a conversation's system-prompt cache, which leaves the whole history to
   prefill yet, with 550-token system prompts, would serve about 81% of the tokens: read the
   warm-turns column beside it (in the run in docs/benchmarks.md mlx_lm.server's thrashing
   runs served 0-54%).

   Why replies of 32 tokens: an assistant's reply of a sentence or two. A server that cannot
   follow the reply as the chat template re-renders it into the next prompt prefills it again
   (mlx_lm.server does; Courier extends the conversation over it while idle), so unrealistically
   short replies hide that difference; and at the earlier 8 tokens each turn's new question (20
   tokens, which no cache can serve) was 5.4% of the turns-2+ prompt tokens, so no server
   could reach the issue's 95%.

   Why 550 tokens of system prompt: the issue's anchor measurement is that mlx_lm.server with
   `--prompt-cache-size 100`, serving 8 conversations interleaved on a hybrid model, serves 92%
   of turns-2+ prompt tokens from cache. Measured on this workload with 32-token replies (K=8,
   qwen3_next): 450 tokens 91.3%, 550 91.8%; 550 reproduces it to the percent. (With 8-token
   replies 285 tokens did: 250 91.0%, 285 92.0%, 300 93.0%.) The new questions are then 2.9%
   (hybrid) to 3.2% (dense) of the turns-2+ prompt tokens, so no server can pass about 97.1%
   (hybrid) or 96.9% (dense).

   mlx_lm.server (`mlx-lm-f32`) serves the tiny float32 weights with `LD_PRELOAD=<OpenBLAS>`
   and `--log-level WARNING`. It has no sessions: it ignores `user` and shares one cache across
   requests. It applies `--prompt-cache-bytes` when it admits a request, after that request's
   cache lookup, so between requests its cache may hold more than B.
   Courier's `snapshot_entries`, `snapshot_evictions_lru` and `snapshot_self_evictions` are
   printed after each K (its store is reset after the warm-up request, so they count the
   conversations only; mlx_lm.server keeps its warm-up cache).

   Servers: `--b-servers` (courier,mlx-lm-f32; plus courier-baseline with `--baseline-tree`).

c. In-process latency of `courier.core.snapshot_store.SnapshotStore`: `--store-entries`
   (10,000) token vectors sharing a 500-token system prefix followed by 50-1500 random tokens,
   inserted one by one under `--store-sessions` sessions, then `--store-lookups` lookups of
   each kind: the next turn of a stored conversation (hit on the whole entry), a new
   conversation on the shared system prefix (hit on the prefix, trimmed) and an unrelated
   prompt (miss). All token vectors are made before anything is timed. Reported: p50/p99 in
   microseconds per kind and for inserts (target: lookups well under 1 ms).

Every server runs on 127.0.0.1 on a free port, one at a time, and gets one warm-up request
before anything is measured; a server run stops after `--run-timeout` seconds of measuring.
mlx_lm.server runs get `HF_HUB_CACHE` set to an empty directory (see bench.throughput). From
the repository root:

    .venv/bin/python -m bench.multiturn [--parts a,b,c] [--conversations 2,8,32] [--turns 10]
        [--a-servers courier,mlx-lm-f32,mlx-lm-4bit] [--b-models llama,qwen3_next]
        [--b-servers courier,mlx-lm-f32] [--b-budgets default,size100,equal]
        [--b-system-tokens 550] [--b-max-tokens 32] [--equal-conversations 4,8,12]
        [--cache-dir DIR] [--json PATH] [--courier-arg=--admission-window-ms=0 ...]
        [--baseline-tree /tmp/courier-baseline]

`--courier-arg` adds a flag to every Courier command line (none by default: defaults are measured).

`--baseline-tree DIR` (a checkout of another commit, e.g. `git worktree add /tmp/courier-baseline
COMMIT`) adds `courier-baseline` to parts a and b by default: Courier at that commit, to show that
a change is not slower. It is started like `courier`, with the same flags (`--courier-arg`, the
equal budget's capacity) and as `PYTHONPATH=DIR python -P -m courier serve ...` out of the same
virtualenv (`-P` keeps the working directory, which holds this tree's `courier`, off the front of
sys.path; the script checks at start-up that DIR's package is the one imported, and stops if not),
and measured exactly like it (cache reset after the warm-up, `/v1/cache/stats`, Courier's default
budget as its unconstrained reference). It runs next to `courier` (after it, or before it when listed
first): in part a beside its conversation, in part b at each K (courier K=2, courier-baseline K=2, ...),
so drift on a noisy machine hits both alike. The report adds "courier / courier-baseline" lines:
the share of turns-2+ prompt tokens cached and TTFT p50 of turns 2+ (part a, and part b for each
model, budget and K), and conversations held warm at the equal budget.

Markdown tables go to stdout, progress to stderr, server logs to CACHE/bench-logs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from bench.throughput import (
    COURIER,
    COURIER_BASELINE,
    COURIER_MODEL_ID,
    HOST,
    MLX_LM_4BIT,
    MLX_LM_F32,
    MLX_LM_MODEL_ID,
    OPENBLAS_PATH,
    WARMUP_PROMPT,
    BenchmarkError,
    add_baseline_argument,
    baseline_ready,
    cache_directory,
    choose_servers,
    courier_launcher,
    environment,
    free_port,
    in_run_order,
    is_courier,
    load_float32,
    percentile,
    positive_ints,
    prepare_4bit_dir,
    progress,
    ready_path,
    release_mlx_memory,
    running_server,
    save_float32_dir,
    server_env,
    server_extra_env,
    server_list,
    wait_until_ready,
)
from courier.platform.blas import load_optimized_blas

PARTS = ("a", "b", "c")
TINY_MODELS = ("llama", "qwen3_next")
A_SERVERS = (COURIER, MLX_LM_F32, MLX_LM_4BIT)
B_SERVERS = (COURIER, COURIER_BASELINE, MLX_LM_F32)
DEFAULT_BUDGET = "default"
ANCHOR_BUDGET = "size100"
EQUAL_BUDGET = "equal"
B_BUDGETS = (DEFAULT_BUDGET, ANCHOR_BUDGET, EQUAL_BUDGET)
ANCHOR_CACHE_SIZE = 100  # the anchor: mlx_lm.server --prompt-cache-size 100
TINY_SERVED_NAME = "tiny"
COURIER_DEFAULT_MAX_ENTRIES = 4096  # `--prompt-cache-snapshot-max-entries` default, given to mlx_lm.server too
DEFAULT_SYSTEM_TOKENS_B = 550  # calibrated: see the module docstring
DEFAULT_MAX_TOKENS_B = 32  # an assistant reply of a sentence or two: see the module docstring
EQUAL_CONVERSATIONS = [*range(4, 17), 20, 24]
BUDGET_STATES = 16
REFERENCE_K = 8
WARM_FRACTION = 0.8
GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": re-rendered with the reply, so a warm turn may redo it
REQUEST_TIMEOUT_S = 300.0
RUN_ERRORS = (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError)
T = TypeVar("T")

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


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerLaunch:
    """One server process: how it was started and whether it served."""

    label: str
    command: list[str]
    extra_env: dict[str, str]
    ready_s: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnResult:
    """One streamed chat completion; `conversation` and `turn` count from 1."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    ttft_s: float
    total_s: float
    empty_reply: bool
    reply: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationRun:
    """Part a: one server's conversation."""

    server: ServerLaunch
    turns: list[TurnResult]
    courier_stats: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class InterleavedRun:
    """Part b: K interleaved conversations on one server process."""

    model: str
    budget: str
    budget_bytes: int | None
    conversations: int
    server: ServerLaunch
    cached_share: float | None
    warm_turns: float | None
    ttft_p50_later_s: float | None
    ttft_p50_first_s: float | None
    empty_replies: int
    courier_stats: dict[str, Any] | None
    turns: list[TurnResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteBudget:
    """Part b's equal byte budget for one model, and where it came from."""

    model: str
    capacity_bytes: int
    explanation: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldWarm:
    """Part b: how many conversations one server kept warm at the equal byte budget."""

    model: str
    server: str
    reference_share: float | None  # its cached share with an unconstrained cache at K=REFERENCE_K
    threshold: float | None
    conversations: int | None  # the largest swept K up to which every share stays >= threshold (0: none)
    at_least: bool = False  # every swept K stayed warm: the sweep, not the budget, set the count


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencySummary:
    operation: str
    count: int
    p50_us: float
    p99_us: float
    max_us: float
    unexpected: int  # lookups whose outcome was not the kind's (a hit that missed, ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLatencyResult:
    entries: int
    sessions: int
    prefix_tokens: int
    suffix_tokens: tuple[int, int]
    build_s: float
    operations: list[LatencySummary]


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    conversation: list[ConversationRun]
    interleaved: list[InterleavedRun]
    budgets: list[ByteBudget]
    held_warm: list[HeldWarm]
    store: StoreLatencyResult | None


# ---------------------------------------------------------------- servers


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """What to start: `label` is one of bench.throughput's server names."""

    label: str
    model_dir: Path | None
    flags: tuple[str, ...] = ()

    @property
    def served_model(self) -> str:
        if not is_courier(self.label):
            return MLX_LM_MODEL_ID
        return COURIER_MODEL_ID if self.model_dir is None else TINY_SERVED_NAME

    def command(self, port: int, cache_dir: Path) -> list[str]:
        if is_courier(self.label):
            command = [*courier_launcher(self.label), "serve", "--port", str(port), "--cache-dir", str(cache_dir)]
            if self.model_dir is not None:
                command += ["--model", str(self.model_dir), "--served-model-name", TINY_SERVED_NAME]
            return command + list(self.flags)
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir), "--port", str(port)]
        return command + list(self.flags)


def serve_and_measure(
    spec: ServerSpec, cache_dir: Path, log_name: str, args: argparse.Namespace, measure: Callable[[str], T]
) -> tuple[ServerLaunch, T | None]:
    """Start `spec`, wait until ready, run `measure(base_url)`, stop it; failures land in the launch's error."""
    port = free_port()
    command = spec.command(port, cache_dir)
    extra_env = server_extra_env(spec.label, args.openblas, cache_dir, baseline_tree=args.baseline_tree)
    log_path = cache_dir / "bench-logs" / f"multiturn-{log_name}.log"
    env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
    progress(f"{log_name}: starting {env_text + ' ' if env_text else ''}{shlex.join(command)} (log: {log_path})")
    ready_s: float | None = None
    try:
        with running_server(command, server_env(extra_env), log_path) as process:
            ready_s = wait_until_ready(process, f"http://{HOST}:{port}{ready_path(spec.label)}", log_path)
            progress(f"{log_name}: ready after {ready_s:.1f} s")
            result = measure(f"http://{HOST}:{port}")
    except RUN_ERRORS as error:
        message = f"{type(error).__name__}: {error}"
        progress(f"{log_name}: FAILED: {message}")
        return ServerLaunch(
            label=spec.label, command=command, extra_env=extra_env, ready_s=ready_s, error=message
        ), None
    return ServerLaunch(label=spec.label, command=command, extra_env=extra_env, ready_s=ready_s), result


def make_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def courier_stats(base_url: str) -> dict[str, Any]:
    with httpx.Client(timeout=30.0) as http:
        response = http.get(f"{base_url}/v1/cache/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats


def reset_courier_cache(base_url: str) -> None:
    with httpx.Client(timeout=30.0) as http:
        http.post(f"{base_url}/v1/cache/reset").raise_for_status()


# ---------------------------------------------------------------- one turn


def chat_turn(
    client: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    *,
    max_tokens: int,
    user: str | None,
    conversation: int,
    turn: int,
) -> TurnResult:
    """Stream one completion; TTFT runs to the first content delta (to the finish chunk if none carries text)."""
    sent = time.perf_counter()
    first: float | None = None
    finish: float | None = None
    pieces: list[str] = []
    usage: CompletionUsage | None = None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        user=user if user is not None else openai.omit,
    )
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                first = now if first is None else first
            if choice.finish_reason is not None and finish is None:
                finish = now
    done = time.perf_counter()
    if usage is None:
        raise BenchmarkError(f"conversation {conversation} turn {turn}: the stream carried no usage")
    details = usage.prompt_tokens_details
    first_token = first if first is not None else (finish if finish is not None else done)
    return TurnResult(
        conversation=conversation,
        turn=turn,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=details.cached_tokens if details is not None else None,
        completion_tokens=usage.completion_tokens,
        ttft_s=first_token - sent,
        total_s=done - sent,
        empty_reply=first is None,
        reply="".join(pieces),
    )


def warm_up(client: openai.OpenAI, model: str) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": WARMUP_PROMPT}]
    chat_turn(client, model, messages, max_tokens=8, user="bench-warm-up", conversation=0, turn=0)


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise BenchmarkError(f"{what}: stopped after the --run-timeout")


def later_turns(turns: Sequence[TurnResult]) -> list[TurnResult]:
    return [turn for turn in turns if turn.turn >= 2]


def cached_share(turns: Sequence[TurnResult]) -> float | None:
    later = later_turns(turns)
    if not later or any(turn.cached_tokens is None for turn in later):
        return None
    prompt = sum(turn.prompt_tokens for turn in later)
    return sum(turn.cached_tokens or 0 for turn in later) / prompt if prompt else None


def median_ttft(turns: Sequence[TurnResult]) -> float | None:
    return statistics.median(turn.ttft_s for turn in turns) if turns else None


# ---------------------------------------------------------------- part a: one long conversation


def user_message_a(turn: int) -> str:
    base = USER_MESSAGES_A[turn % len(USER_MESSAGES_A)]
    return base if turn < len(USER_MESSAGES_A) else f"{base} (question {turn + 1})"


def converse(
    base_url: str, spec: ServerSpec, turns: int, max_tokens: int, run_timeout_s: float
) -> tuple[list[TurnResult], dict[str, Any] | None]:
    """The conversation's turns, and Courier's cache stats after the last one."""
    deadline = time.monotonic() + run_timeout_s
    results: list[TurnResult] = []
    with make_client(base_url) as client:
        warm_up(client, spec.served_model)
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM_PROMPT_A}]
        for turn in range(turns):
            check_deadline(deadline, f"{spec.label} conversation")
            messages.append({"role": "user", "content": user_message_a(turn)})
            result = chat_turn(
                client, spec.served_model, messages, max_tokens=max_tokens, user=None, conversation=1, turn=turn + 1
            )
            results.append(result)
            messages.append({"role": "assistant", "content": result.reply})
    return results, courier_stats(base_url) if is_courier(spec.label) else None


def part_a_specs(
    labels: Sequence[str], dir4: Path, dir_f32: Path | None, courier_args: Sequence[str]
) -> list[ServerSpec]:
    specs: list[ServerSpec] = []
    for label in labels:
        if is_courier(label):
            specs.append(ServerSpec(label=label, model_dir=None, flags=tuple(courier_args)))
        elif label == MLX_LM_F32:
            specs.append(ServerSpec(label=MLX_LM_F32, model_dir=dir_f32, flags=("--log-level", "WARNING")))
        else:
            specs.append(ServerSpec(label=MLX_LM_4BIT, model_dir=dir4))
    return specs


def run_part_a(cache_dir: Path, dir4: Path, args: argparse.Namespace) -> list[ConversationRun]:
    dir_f32: Path | None = None
    if MLX_LM_F32 in args.a_servers:
        progress("dequantizing the 4-bit SmolLM2 directory to float32 for mlx-lm-f32")
        model, _ = load_float32(dir4)
        dir_f32 = save_float32_dir(model, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
        del model
        release_mlx_memory()
    runs: list[ConversationRun] = []
    for spec in part_a_specs(args.a_servers, dir4, dir_f32, args.courier_arg):

        def measure(base_url: str, spec: ServerSpec = spec) -> tuple[list[TurnResult], dict[str, Any] | None]:
            return converse(base_url, spec, args.turns, args.a_max_tokens, args.run_timeout)

        launch, result = serve_and_measure(spec, cache_dir, f"a-{spec.label}", args, measure)
        turns, stats = result if result is not None else ([], None)
        runs.append(ConversationRun(server=launch, turns=turns, courier_stats=stats))
    return runs


# ---------------------------------------------------------------- part b: K interleaved conversations


def system_prompt_b(k: int, index: int, handbook: str) -> str:
    return f"You are the support assistant for customer {index + 1} of {k}, account AC-{k:02d}{index:04d}. {handbook}"


def user_message_b(index: int, turn: int) -> str:
    return f"Message {turn + 1}: {QUESTIONS_B[(index + turn) % len(QUESTIONS_B)]}"


def cut_handbook(tokenizer: Any, system_tokens: int) -> str:
    """HANDBOOK_B cut at a word (repeated when too short) so that a system prompt is about `system_tokens` long."""
    words = HANDBOOK_B.split()

    def measure(count: int) -> int:
        text = " ".join(words[index % len(words)] for index in range(count))
        return len(tokenizer.encode(system_prompt_b(32, 31, text), add_special_tokens=False))

    low, high = 0, len(words)
    while measure(high) < system_tokens:
        high *= 2
    while low < high:  # the fewest words that reach the length
        middle = (low + high) // 2
        low, high = (middle + 1, high) if measure(middle) < system_tokens else (low, middle)
    return " ".join(words[index % len(words)] for index in range(low))


def last_prompt_b(tokenizer: Any, handbook: str, args: argparse.Namespace) -> list[int]:
    """A conversation's last prompt, its replies stood in for by `--b-max-tokens` one-token words."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt_b(32, 0, handbook)}]
    for turn in range(args.b_turns):
        if turn:
            messages.append({"role": "assistant", "content": " ".join(["ok"] * args.b_max_tokens)})
        messages.append({"role": "user", "content": user_message_b(0, turn)})
    tokens: list[int] = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokens


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


def prepare_b(model: str, model_dir: Path, args: argparse.Namespace) -> tuple[str, ByteBudget]:
    """The handbook text for `--b-system-tokens`, and the equal byte budget: `--budget-states` model states of a
    conversation at its last prompt, weighed in this process on mlx-lm's own cache (or `--budget-bytes`)."""
    from mlx_lm import load

    loaded, tokenizer = load(str(model_dir))
    handbook = cut_handbook(tokenizer, args.b_system_tokens)
    system = len(tokenizer.encode(system_prompt_b(32, 0, handbook), add_special_tokens=False))
    last = last_prompt_b(tokenizer, handbook, args)
    one_state = state_bytes(loaded, last)
    del loaded
    release_mlx_memory()
    workload = (
        f"system prompt {system} tokens, last prompt of a conversation about {len(last)} tokens, one model state "
        f"there {one_state} B (mlx-lm cache contents)"
    )
    if args.budget_bytes is not None:
        return handbook, ByteBudget(
            model=model, capacity_bytes=args.budget_bytes, explanation=f"--budget-bytes; {workload}"
        )
    capacity = args.budget_states * one_state
    explanation = f"{args.budget_states} model states of {one_state} B; {workload}"
    return handbook, ByteBudget(model=model, capacity_bytes=capacity, explanation=explanation)


def interleave(base_url: str, spec: ServerSpec, k: int, handbook: str, args: argparse.Namespace) -> list[TurnResult]:
    deadline = time.monotonic() + args.run_timeout
    histories: list[list[ChatCompletionMessageParam]] = [
        [{"role": "system", "content": system_prompt_b(k, index, handbook)}] for index in range(k)
    ]
    results: list[TurnResult] = []
    with make_client(base_url) as client:
        warm_up(client, spec.served_model)
        if is_courier(spec.label):
            reset_courier_cache(base_url)
        for turn in range(args.b_turns):
            check_deadline(deadline, f"{spec.label} K={k}")
            for index, messages in enumerate(histories):
                messages.append({"role": "user", "content": user_message_b(index, turn)})
                result = chat_turn(
                    client,
                    spec.served_model,
                    messages,
                    max_tokens=args.b_max_tokens,
                    user=f"k{k}-conversation-{index + 1}",
                    conversation=index + 1,
                    turn=turn + 1,
                )
                results.append(result)
                messages.append({"role": "assistant", "content": result.reply})
    return results


def part_b_spec(
    label: str, model_dir: Path, budget: str, budget_bytes: int | None, args: argparse.Namespace
) -> ServerSpec:
    if is_courier(label):
        flags = list(args.courier_arg)
        if budget == EQUAL_BUDGET:
            flags += ["--prompt-cache-snapshot-capacity-bytes", str(budget_bytes)]
        return ServerSpec(label=label, model_dir=model_dir, flags=tuple(flags))
    flags = ["--log-level", "WARNING"]
    if budget == ANCHOR_BUDGET:
        flags += ["--prompt-cache-size", str(ANCHOR_CACHE_SIZE)]
    elif budget == EQUAL_BUDGET:
        flags += ["--prompt-cache-bytes", str(budget_bytes), "--prompt-cache-size", str(COURIER_DEFAULT_MAX_ENTRIES)]
    return ServerSpec(label=MLX_LM_F32, model_dir=model_dir, flags=tuple(flags))


def warm_turns(turns: Sequence[TurnResult]) -> float | None:
    """The share of turns 2+ served from the state the conversation's previous turn left: at least its whole
    previous prompt but the generation prompt came from the cache (a system prompt alone does not count)."""
    previous: dict[int, TurnResult] = {}
    warm = counted = 0
    for turn in sorted(turns, key=lambda item: (item.conversation, item.turn)):
        before = previous.get(turn.conversation)
        previous[turn.conversation] = turn
        if before is None or turn.cached_tokens is None:
            continue
        counted += 1
        warm += turn.cached_tokens >= before.prompt_tokens - GENERATION_PROMPT_TOKENS
    return warm / counted if counted else None


def run_interleaved(
    cache_dir: Path,
    *,
    model: str,
    model_dir: Path,
    label: str,
    k: int,
    budget: str,
    budget_bytes: int | None,
    handbook: str,
    args: argparse.Namespace,
) -> InterleavedRun:
    spec = part_b_spec(label, model_dir, budget, budget_bytes, args)

    def measure(base_url: str) -> tuple[list[TurnResult], dict[str, Any] | None]:
        turns = interleave(base_url, spec, k, handbook, args)
        return turns, courier_stats(base_url) if is_courier(label) else None

    log_name = f"b-{model}-{label}-{budget}-k{k}"
    launch, result = serve_and_measure(spec, cache_dir, log_name, args, measure)
    turns, stats = result if result is not None else ([], None)
    later = later_turns(turns)
    share = cached_share(turns)
    extra = ""
    if stats is not None:
        keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions", "snapshot_bytes_per_entry")
        extra = "".join(f", {key} {stats.get(key)}" for key in keys)
    progress(f"{log_name}: cached share {share_text(share)}, warm turns {share_text(warm_turns(turns))}{extra}")
    return InterleavedRun(
        model=model,
        budget=budget,
        budget_bytes=budget_bytes if budget == EQUAL_BUDGET else None,
        conversations=k,
        server=launch,
        cached_share=share,
        warm_turns=warm_turns(turns),
        ttft_p50_later_s=median_ttft(later),
        ttft_p50_first_s=median_ttft([turn for turn in turns if turn.turn == 1]),
        empty_replies=sum(turn.empty_reply for turn in turns),
        courier_stats=stats,
        turns=turns,
    )


def held_warm(model: str, runs: Sequence[InterleavedRun], label: str) -> HeldWarm:
    """The largest swept K up to which `label`'s share at the equal budget stays >= WARM_FRACTION of its share with
    an unconstrained cache (Courier's default, mlx_lm.server's --prompt-cache-size 100) at K=REFERENCE_K."""
    unconstrained = DEFAULT_BUDGET if is_courier(label) else ANCHOR_BUDGET
    reference = next(
        (
            r.cached_share
            for r in runs
            if (r.server.label, r.budget, r.conversations) == (label, unconstrained, REFERENCE_K)
        ),
        None,
    )
    swept = sorted(
        (r for r in runs if r.server.label == label and r.budget == EQUAL_BUDGET), key=lambda r: r.conversations
    )
    if reference is None or not swept:
        return HeldWarm(model=model, server=label, reference_share=reference, threshold=None, conversations=None)
    threshold = WARM_FRACTION * reference
    conversations = 0
    for run in swept:
        if run.cached_share is None or run.cached_share < threshold:
            break
        conversations = run.conversations
    at_least = conversations == swept[-1].conversations
    return HeldWarm(
        model=model,
        server=label,
        reference_share=reference,
        threshold=threshold,
        conversations=conversations,
        at_least=at_least,
    )


def build_tiny_model(model: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    from tests.support.tiny_models import build_llama, build_qwen3_next

    target = cache_dir / "bench-models" / f"tiny-{model}"
    if model == "llama":
        return build_llama(tokenizer_dir, target, quantized=False)
    return build_qwen3_next(tokenizer_dir, target)


def server_groups(labels: Sequence[str]) -> list[list[str]]:
    """Servers whose runs alternate K by K: the two Courier servers (in the order given) form one group, so drift on a
    noisy machine hits both alike; every other server is a group of its own."""
    groups: list[list[str]] = []
    for label in in_run_order(labels):
        if is_courier(label) and groups and is_courier(groups[-1][0]):
            groups[-1].append(label)  # in_run_order put the two next to each other
        else:
            groups.append([label])
    return groups


def part_b_plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(budget, server, K) of every run, in order: defaults, the size-100 anchor, then the equal-budget sweep."""
    plan: list[tuple[str, str, int]] = []
    for budget in args.b_budgets:
        labels = [label for label in args.b_servers if budget != ANCHOR_BUDGET or label == MLX_LM_F32]
        ks = args.equal_conversations if budget == EQUAL_BUDGET else args.conversations
        plan += [(budget, label, k) for group in server_groups(labels) for k in ks for label in group]
    return plan


def run_part_b(
    cache_dir: Path, dir4: Path, args: argparse.Namespace
) -> tuple[list[InterleavedRun], list[ByteBudget], list[HeldWarm]]:
    runs: list[InterleavedRun] = []
    budgets: list[ByteBudget] = []
    held: list[HeldWarm] = []
    for model in args.b_models:
        model_dir = build_tiny_model(model, dir4, cache_dir)
        handbook, budget = prepare_b(model, model_dir, args)
        progress(f"tiny {model} model: {model_dir}; equal byte budget {budget.capacity_bytes} B ({budget.explanation})")
        model_runs = [
            run_interleaved(
                cache_dir,
                model=model,
                model_dir=model_dir,
                label=label,
                k=k,
                budget=name,
                budget_bytes=budget.capacity_bytes,
                handbook=handbook,
                args=args,
            )
            for name, label, k in part_b_plan(args)
        ]
        runs += model_runs
        if EQUAL_BUDGET in args.b_budgets:
            budgets.append(budget)
            held += [held_warm(model, model_runs, label) for label in args.b_servers]
    return runs, budgets, held


# ---------------------------------------------------------------- part c: store latency


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreWorkload:
    """Every token vector of part c, made before anything is timed."""

    vectors: list[tuple[int, ...]]
    sessions: list[str]
    lookups: dict[str, list[tuple[str, tuple[int, ...], int]]]  # kind -> (session, tokens, least matched; 0: miss)


def make_workload(entries: int, sessions: int, lookups: int, seed: int) -> StoreWorkload:
    rng = random.Random(seed)
    vocab = list(range(STORE_VOCAB))  # shared int objects keep the vectors' memory at a pointer per token
    prefix = tuple(rng.choices(vocab, k=STORE_PREFIX_TOKENS))
    low, high = STORE_SUFFIX_TOKENS
    vectors = [prefix + tuple(rng.choices(vocab, k=rng.randint(low, high))) for _ in range(entries)]
    names = [f"user-{index % sessions}" for index in range(entries)]
    next_turns: list[tuple[str, tuple[int, ...], int]] = []
    for _ in range(lookups):
        index = rng.randrange(entries)
        tokens = vectors[index] + tuple(rng.choices(vocab, k=STORE_NEXT_TURN_TOKENS))
        next_turns.append((names[index], tokens, len(vectors[index])))
    shared = [
        (f"new-{index}", prefix + tuple(rng.choices(vocab, k=STORE_NEW_CONVERSATION_TOKENS)), STORE_PREFIX_TOKENS)
        for index in range(lookups)
    ]
    others = [token for token in vocab if token != prefix[0]]
    misses = [
        (f"new-{index}", (rng.choice(others), *rng.choices(vocab, k=STORE_MISS_TOKENS - 1)), 0)
        for index in range(lookups)
    ]
    kinds = {LOOKUP_NEXT_TURN: next_turns, LOOKUP_SHARED_PREFIX: shared, LOOKUP_MISS: misses}
    return StoreWorkload(vectors=vectors, sessions=names, lookups=kinds)


def summarize(operation: str, samples_ns: Sequence[int], unexpected: int) -> LatencySummary:
    micros = [sample / 1000 for sample in samples_ns]
    return LatencySummary(
        operation=operation,
        count=len(micros),
        p50_us=percentile(micros, 0.50),
        p99_us=percentile(micros, 0.99),
        max_us=max(micros),
        unexpected=unexpected,
    )


def measure_store(args: argparse.Namespace) -> StoreLatencyResult:
    from courier.core.snapshot_store import Bucket, Origin, SnapshotStore, StoreLimits

    progress(f"store: making {args.store_entries} vectors and {args.store_lookups} lookups of each kind")
    workload = make_workload(args.store_entries, args.store_sessions, args.store_lookups, args.seed)
    limits = StoreLimits(
        capacity_bytes=1 << 62, max_entries=2 * args.store_entries, ttl_s=1e9, min_prefix=STORE_MIN_PREFIX
    )
    store = SnapshotStore(limits, trimmable=True, clock=time.monotonic)
    bucket = Bucket("m")
    gc.collect()
    insert_ns: list[int] = []
    build_started = time.perf_counter()
    for session, tokens in zip(workload.sessions, workload.vectors, strict=True):
        started = time.perf_counter_ns()
        store.insert(bucket=bucket, session=session, origin=Origin.COMPLETION, tokens=tokens, state=None, nbytes=1)
        insert_ns.append(time.perf_counter_ns() - started)
    build_s = time.perf_counter() - build_started
    progress(f"store: {store.entries} entries inserted in {build_s:.1f} s; timing lookups")
    operations = [summarize(f"insert (store growing to {store.entries})", insert_ns, 0)]
    for kind, queries in workload.lookups.items():
        samples: list[int] = []
        unexpected = 0
        for session, tokens, expected in queries:
            started = time.perf_counter_ns()
            result = store.lookup(bucket, session, tokens)
            samples.append(time.perf_counter_ns() - started)
            # A hit must reach at least its expected length (a new suffix may match a stored token by chance).
            unexpected += result.matched < expected if expected else result.matched != 0
        operations.append(summarize(kind, samples, unexpected))
    return StoreLatencyResult(
        entries=store.entries,
        sessions=args.store_sessions,
        prefix_tokens=STORE_PREFIX_TOKENS,
        suffix_tokens=STORE_SUFFIX_TOKENS,
        build_s=build_s,
        operations=operations,
    )


# ---------------------------------------------------------------- report


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def share_text(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def command_text(launch: ServerLaunch) -> str:
    """The command with its port written as PORT, so runs that differ only there print alike."""
    words = list(launch.command)
    if "--port" in words:
        words[words.index("--port") + 1] = "PORT"
    env_text = " ".join(f"{key}={value}" for key, value in launch.extra_env.items())
    return (env_text + " " if env_text else "") + shlex.join(words)


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier multi-turn benchmark\n")
    print(f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, courier {env['courier']}")
    print(f"- machine: {env['platform']} ({env['machine']}, {env['processor']}), {env['cpu_count']} CPUs")
    print(f"- settings: {report.settings}\n")
    if report.conversation:
        print_part_a(report.conversation)
    if report.interleaved:
        print_part_b(report.interleaved, report.budgets, report.held_warm)
    if report.store is not None:
        print_part_c(report.store)


def print_launches(launches: Sequence[ServerLaunch]) -> None:
    seen: set[str] = set()
    for launch in launches:
        text = command_text(launch)
        if text not in seen:
            seen.add(text)
            print(f"- `{launch.label}`: `{text}`")
    for launch in launches:
        if launch.error is not None:
            print(f"- FAILED `{launch.label}` ({command_text(launch)}): {launch.error.splitlines()[0]}")
    print()


def turn_cells(run: ConversationRun, turn: int) -> str:
    result = next((item for item in run.turns if item.turn == turn), None)
    if result is None:
        return " | | |"
    cached = "n/a" if result.cached_tokens is None else str(result.cached_tokens)
    return f" {ms(result.ttft_s)} | {result.prompt_tokens} | {cached} |"


def print_part_a(runs: Sequence[ConversationRun]) -> None:
    print("### (a) One conversation, ~300-token system prompt, SmolLM2-135M-Instruct\n")
    print_launches([run.server for run in runs])
    header = "| turn |" + "".join(f" {run.server.label} TTFT ms | prompt | cached |" for run in runs)
    print(header)
    print("|---|" + "---|---|---|" * len(runs))
    for turn in range(1, 1 + max((len(run.turns) for run in runs), default=0)):
        print(f"| {turn} |" + "".join(turn_cells(run, turn) for run in runs))
    summary = "".join(
        f" {ms(median_ttft(later_turns(run.turns)))} | | {share_text(cached_share(run.turns))} |" for run in runs
    )
    print(f"| p50 / share, turns 2+ |{summary}\n")
    ours = next((run for run in runs if run.server.label == COURIER), None)
    theirs = next((run for run in runs if run.server.label == COURIER_BASELINE), None)
    if ours is not None and theirs is not None:
        print(baseline_line("", ours.turns, theirs.turns))
    for run in runs:
        if run.courier_stats is not None:
            keys = ("snapshot_entries", "snapshot_hits", "snapshot_lookups", "snapshot_supersedes", "tokens_reused")
            print(
                f"- {run.server.label} cache stats: " + ", ".join(f"{key} {run.courier_stats.get(key)}" for key in keys)
            )
    print()


def ratio_text(ours: float | None, theirs: float | None, show: Callable[[float | None], str]) -> str:
    """Both figures and their ratio, as in "97.1% / 97.0% = 1.001x"."""
    ratio = "n/a" if ours is None or not theirs else f"{ours / theirs:.3f}x"
    return f"{show(ours)} / {show(theirs)} = {ratio}"


def baseline_line(where: str, ours: Sequence[TurnResult], theirs: Sequence[TurnResult]) -> str:
    """The "courier / courier-baseline" line: cached share (above 1 favours courier) and TTFT p50 (below 1 does) of
    turns 2+."""
    shares = ratio_text(cached_share(ours), cached_share(theirs), share_text)
    ttfts = ratio_text(median_ttft(later_turns(ours)), median_ttft(later_turns(theirs)), ms)
    return f"- courier / courier-baseline{where}: cached share, turns 2+ {shares}; TTFT p50 ms, turns 2+ {ttfts}"


def courier_cells(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "- | - | -"
    keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions")
    return " | ".join(str(stats.get(key, "?")) for key in keys)


def budget_label(run: InterleavedRun) -> str:
    if run.budget == EQUAL_BUDGET:
        return f"equal ({run.budget_bytes} B)"
    if run.budget == ANCHOR_BUDGET:
        return f"--prompt-cache-size {ANCHOR_CACHE_SIZE}"
    return run.budget


def print_baseline_lines(runs: Sequence[InterleavedRun]) -> None:
    """courier / courier-baseline for every (model, budget, K) both ran."""
    baseline = {(run.model, run.budget, run.conversations): run for run in runs if run.server.label == COURIER_BASELINE}
    pairs = [
        (run, baseline[run.model, run.budget, run.conversations])
        for run in runs
        if run.server.label == COURIER and (run.model, run.budget, run.conversations) in baseline
    ]
    for ours, theirs in pairs:
        print(baseline_line(f", {ours.model}, {budget_label(ours)}, K={ours.conversations}", ours.turns, theirs.turns))
    if pairs:
        print()


def print_part_b(runs: Sequence[InterleavedRun], budgets: Sequence[ByteBudget], held: Sequence[HeldWarm]) -> None:
    print("### (b) K interleaved conversations, tiny models\n")
    print_launches([run.server for run in runs])
    for budget in budgets:
        print(f"- equal budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print()
    print(
        "| model | budget | K | server | cached share, turns 2+ | warm turns | TTFT p50 ms, turns 2+ "
        "| TTFT p50 ms, turn 1 | empty replies | courier entries | evictions_lru | self_evictions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {name: index for index, name in enumerate(B_BUDGETS)}
    for run in sorted(runs, key=lambda item: (item.model, order[item.budget], item.server.label, item.conversations)):
        share = "FAILED" if run.server.error is not None else share_text(run.cached_share)
        print(
            f"| {run.model} | {budget_label(run)} | {run.conversations} | {run.server.label} | {share} "
            f"| {share_text(run.warm_turns)} | {ms(run.ttft_p50_later_s)} | {ms(run.ttft_p50_first_s)} "
            f"| {run.empty_replies} | {courier_cells(run.courier_stats)} |"
        )
    print()
    print_baseline_lines(runs)
    if not held:
        return
    print(
        f"Conversations held warm at the equal budget: the largest swept K up to which the cached share stays >= "
        f"{WARM_FRACTION:.0%} of the server's own share with an unconstrained cache at K={REFERENCE_K}.\n"
    )
    print("| model | server | unconstrained share | threshold | conversations held warm |")
    print("|---|---|---|---|---|")
    for item in held:
        threshold = "n/a" if item.threshold is None else f"{item.threshold:.1%}"
        count = "n/a" if item.conversations is None else f"{'>= ' if item.at_least else ''}{item.conversations}"
        print(f"| {item.model} | {item.server} | {share_text(item.reference_share)} | {threshold} | {count} |")
    print()
    for model in dict.fromkeys(item.model for item in held):
        counts = {item.server: item.conversations for item in held if item.model == model}
        ours, theirs = counts.get(COURIER), counts.get(MLX_LM_F32)
        capped = any(item.at_least for item in held if item.model == model)
        if ours is not None and theirs:
            note = " (a count reached the end of the sweep: widen --equal-conversations)" if capped else ""
            print(f"- {model}: courier / mlx_lm.server = {ours} / {theirs} = {ours / theirs:.2f}x{note}")
        else:
            print(f"- {model}: courier {ours}, mlx_lm.server {theirs}: no ratio")
        if COURIER_BASELINE in counts:
            count_text = ratio_text(ours, counts[COURIER_BASELINE], lambda n: "n/a" if n is None else f"{n:.0f}")
            print(f"- {model}: courier / courier-baseline = {count_text}")
    print()


def print_part_c(store: StoreLatencyResult) -> None:
    low, high = store.suffix_tokens
    print(f"### (c) Snapshot store latency, {store.entries} entries in process\n")
    print(
        f"- vectors: a {store.prefix_tokens}-token shared prefix + {low}-{high} random tokens, "
        f"{store.sessions} sessions; built in {store.build_s:.1f} s\n"
    )
    print("| operation | count | p50 us | p99 us | max us | unexpected outcomes |")
    print("|---|---|---|---|---|---|")
    for op in store.operations:
        print(
            f"| {op.operation} | {op.count} | {op.p50_us:.1f} | {op.p99_us:.1f} | {op.max_us:.1f} | {op.unexpected} |"
        )
    lookups = [op for op in store.operations if op.operation.startswith("lookup")]
    worst = max((op.p99_us for op in lookups), default=float("nan"))
    verdict = "meets" if worst < STORE_LOOKUP_TARGET_US else "misses"
    print(f"\n- worst lookup p99 {worst:.1f} us: {verdict} the target (< {STORE_LOOKUP_TARGET_US:.0f} us)\n")


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in allowed]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--parts", type=choices(PARTS), default=list(PARTS), help="parts to run (a,b,c)")
    add("--conversations", type=positive_ints, default=[2, 8, 32], help="part b: K values (2,8,32)")
    add("--turns", type=int, default=10, help="part a: turns of the conversation (10)")
    add("--a-max-tokens", type=int, default=24, help="part a: max_tokens per turn (24)")
    add(
        "--a-servers",
        type=server_list,
        default=None,
        help=f"part a servers ({','.join(A_SERVERS)}, plus {COURIER_BASELINE} with --baseline-tree)",
    )
    add("--b-turns", type=int, default=4, help="part b: turns per conversation (4)")
    add(
        "--b-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS_B,
        help=f"part b: max_tokens per turn ({DEFAULT_MAX_TOKENS_B})",
    )
    add("--b-models", type=choices(TINY_MODELS), default=list(TINY_MODELS), help="part b models (llama,qwen3_next)")
    add(
        "--b-servers",
        type=choices(B_SERVERS),
        default=None,
        help=f"part b servers ({','.join(B_SERVERS)}; {COURIER_BASELINE} only with --baseline-tree)",
    )
    add(
        "--b-system-tokens",
        type=int,
        default=DEFAULT_SYSTEM_TOKENS_B,
        help=f"part b: tokens of each conversation's system prompt ({DEFAULT_SYSTEM_TOKENS_B}, calibrated)",
    )
    add("--b-budgets", type=choices(B_BUDGETS), default=list(B_BUDGETS), help=f"part b budgets ({','.join(B_BUDGETS)})")
    add(
        "--equal-conversations",
        type=positive_ints,
        default=EQUAL_CONVERSATIONS,
        help=f"part b: K values at the equal budget ({','.join(map(str, EQUAL_CONVERSATIONS))})",
    )
    add(
        "--budget-states",
        type=int,
        default=BUDGET_STATES,
        help=f"part b: equal budget in model states ({BUDGET_STATES})",
    )
    add("--budget-bytes", type=int, default=None, help="part b: the equal byte budget itself (default: derived)")
    add(
        "--courier-arg",
        action="append",
        default=[],
        help="extra flag for every Courier server, as --courier-arg=--flag=value (repeatable)",
    )
    add("--store-entries", type=int, default=10_000, help="part c: entries in the store (10000)")
    add("--store-sessions", type=int, default=1000, help="part c: sessions the entries belong to (1000)")
    add("--store-lookups", type=int, default=2000, help="part c: lookups timed per kind (2000)")
    add("--seed", type=int, default=0, help="part c: random seed (0)")
    add("--run-timeout", type=float, default=900.0, help="seconds of measuring one server run may take (900)")
    add("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    add("--json", type=Path, default=None, help="also write the raw results here")
    add("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for mlx_lm.server on float32 ({OPENBLAS_PATH})")
    add_baseline_argument(parser)
    args = parser.parse_args(argv)
    args.a_servers = choose_servers(parser, "--a-servers", args.a_servers, A_SERVERS, args.baseline_tree)
    default_b = [label for label in B_SERVERS if label != COURIER_BASELINE]
    args.b_servers = choose_servers(parser, "--b-servers", args.b_servers, default_b, args.baseline_tree)
    return args


def settings_of(args: argparse.Namespace) -> dict[str, object]:
    keys = (
        *("parts", "conversations", "turns", "a_max_tokens", "a_servers", "b_turns", "b_max_tokens", "b_models"),
        *("b_servers", "b_system_tokens", "b_budgets", "equal_conversations", "budget_states", "budget_bytes"),
        *("courier_arg", "store_entries", "store_lookups"),
    )
    settings = {key: getattr(args, key) for key in keys}
    return settings | {"baseline_tree": str(args.baseline_tree) if args.baseline_tree else None}


def servers_run(args: argparse.Namespace) -> list[str]:
    """Every server parts a and b will start."""
    return [*(args.a_servers if "a" in args.parts else []), *(args.b_servers if "b" in args.parts else [])]


def needs_openblas(args: argparse.Namespace) -> bool:
    return MLX_LM_F32 in servers_run(args)


def run_servers(
    args: argparse.Namespace,
) -> tuple[list[ConversationRun], tuple[list[InterleavedRun], list[ByteBudget], list[HeldWarm]]]:
    """Parts a and b, which share the 4-bit SmolLM2 directory (the tiny models borrow its tokenizer)."""
    if "a" not in args.parts and "b" not in args.parts:
        return [], ([], [], [])
    with cache_directory(args.cache_dir) as cache_dir:
        progress("converting the embedded GGUF to a 4-bit MLX directory")
        dir4 = prepare_4bit_dir(cache_dir)
        conversation = run_part_a(cache_dir, dir4, args) if "a" in args.parts else []
        interleaved = run_part_b(cache_dir, dir4, args) if "b" in args.parts else ([], [], [])
    return conversation, interleaved


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if needs_openblas(args) and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or leave out {MLX_LM_F32}")
        return 2
    if not baseline_ready(args.baseline_tree, servers_run(args)):
        return 2
    blas = load_optimized_blas()  # before MLX is imported, as bench.throughput does
    conversation, (interleaved, budgets, held) = run_servers(args)
    report = Report(
        environment=environment(blas),
        settings=settings_of(args),
        conversation=conversation,
        interleaved=interleaved,
        budgets=budgets,
        held_warm=held,
        store=measure_store(args) if "c" in args.parts else None,
    )
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    failed = [run.server for run in report.conversation] + [run.server for run in report.interleaved]
    return 1 if any(launch.error for launch in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
