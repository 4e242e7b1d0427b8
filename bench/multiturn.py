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
   - `mlx-lm-4bit`: `python -m mlx_lm.server --model DIR4 --port P`, as shipped.

b. K conversations (`--conversations`, 2,8,32) interleaved turn by turn (conversation 1 turn 1,
   conversation 2 turn 1, ..., conversation 1 turn 2, ...), one request at a time, each
   conversation with its own `user` field and system prompt, `--b-turns` (4) turns of
   `max_tokens` 8, on two tiny random-weight models built by `tests/support/tiny_models.py`:
   a dense llama (trimmable KV cache) and a hybrid qwen3_next (gated-delta layers; not
   trimmable). Per server, model and K: the share of turn-2+ prompt tokens served from the
   cache (sum cached / sum prompt over turns >= 2) and TTFT p50 (turns >= 2, and turn 1 apart).
   Every (server, model, K, budget) gets a fresh server process. Two budgets:

   - `default`: both servers with their defaults (Courier sizes its store from the model,
     at least 512 MiB; mlx_lm.server keeps 10 caches, `--prompt-cache-size 10`, no byte cap);
   - `equal`: one byte budget for both, sized from Courier's default run at the largest K:
     (snapshot_bytes_per_entry x snapshot_entries) / K per conversation, times
     `--budget-fraction` (0.5) x K, i.e. room for about half the conversations. Courier gets
     `--prompt-cache-snapshot-capacity-bytes B`; mlx_lm.server gets `--prompt-cache-bytes B`
     and `--prompt-cache-size 4096` (Courier's default entry cap), so that bytes, not its
     10-entry default, are what binds. `--budget-bytes` sets B directly.

   mlx_lm.server (`mlx-lm-f32`) serves the tiny float32 weights with `LD_PRELOAD=<OpenBLAS>`
   and `--log-level WARNING`. It has no sessions: it ignores `user` and shares one cache across
   requests. It applies `--prompt-cache-bytes` when it admits a request, after that request's
   cache lookup, so between requests its cache may hold more than B.
   Courier's `snapshot_entries`, `snapshot_evictions_lru` and `snapshot_self_evictions` are
   printed after each K (its store is reset after the warm-up request, so they count the
   conversations only; mlx_lm.server keeps its warm-up cache).

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
        [--cache-dir DIR] [--json PATH] [--courier-arg=--admission-window-ms=0 ...]

`--courier-arg` adds a flag to every Courier command line (none by default: defaults are measured).

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
    COURIER_MODEL_ID,
    HOST,
    MLX_LM_4BIT,
    MLX_LM_F32,
    MLX_LM_MODEL_ID,
    OPENBLAS_PATH,
    WARMUP_PROMPT,
    BenchmarkError,
    cache_directory,
    environment,
    free_port,
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
    venv_script,
    wait_until_ready,
)
from courier.runtime.blas import load_optimized_blas

PARTS = ("a", "b", "c")
TINY_MODELS = ("llama", "qwen3_next")
B_SERVERS = (COURIER, MLX_LM_F32)
DEFAULT_BUDGET = "default"
EQUAL_BUDGET = "equal"
TINY_SERVED_NAME = "tiny"
COURIER_DEFAULT_MAX_ENTRIES = 4096  # `--prompt-cache-snapshot-max-entries` default, given to mlx_lm.server too
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

# Part b: a system prompt of its own per conversation (so the conversations share no prefix worth
# reusing), short questions.
SYSTEM_RULES_B = (
    "Follow these rules in every answer: be brief and friendly, answer in one sentence when you can, never make up "
    "order numbers, prices or delivery dates, ask one clarifying question when the request is unclear, and offer "
    "to hand the conversation to a human colleague when the customer is unhappy or asks for one. Keep a calm tone."
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
    ttft_p50_later_s: float | None
    ttft_p50_first_s: float | None
    empty_replies: int
    courier_stats: dict[str, Any] | None
    turns: list[TurnResult]


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteBudget:
    """Part b's equal byte budget for one model, and where it came from."""

    model: str
    capacity_bytes: int | None
    explanation: str


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
        if self.label != COURIER:
            return MLX_LM_MODEL_ID
        return COURIER_MODEL_ID if self.model_dir is None else TINY_SERVED_NAME

    def command(self, port: int, cache_dir: Path) -> list[str]:
        if self.label == COURIER:
            command = [venv_script("courier"), "serve", "--port", str(port), "--cache-dir", str(cache_dir)]
            if self.model_dir is not None:
                command += ["--model", str(self.model_dir), "--served-model-name", TINY_SERVED_NAME]
            return command + list(self.flags)
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model_dir), "--port", str(port)]
        return command + list(self.flags)


def serve_and_measure(
    spec: ServerSpec, cache_dir: Path, log_name: str, openblas: str, measure: Callable[[str], T]
) -> tuple[ServerLaunch, T | None]:
    """Start `spec`, wait until ready, run `measure(base_url)`, stop it; failures land in the launch's error."""
    port = free_port()
    command = spec.command(port, cache_dir)
    extra_env = server_extra_env(spec.label, openblas, cache_dir)
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


def cached_share(turns: Sequence[TurnResult]) -> float | None:
    later = [turn for turn in turns if turn.turn >= 2]
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
    return results, courier_stats(base_url) if spec.label == COURIER else None


def part_a_specs(
    labels: Sequence[str], dir4: Path, dir_f32: Path | None, courier_args: Sequence[str]
) -> list[ServerSpec]:
    specs: list[ServerSpec] = []
    for label in labels:
        if label == COURIER:
            specs.append(ServerSpec(label=COURIER, model_dir=None, flags=tuple(courier_args)))
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

        launch, result = serve_and_measure(spec, cache_dir, f"a-{spec.label}", args.openblas, measure)
        turns, stats = result if result is not None else ([], None)
        runs.append(ConversationRun(server=launch, turns=turns, courier_stats=stats))
    return runs


# ---------------------------------------------------------------- part b: K interleaved conversations


def system_prompt_b(k: int, index: int) -> str:
    return f"You are the support assistant for customer {index + 1} of {k}, account AC-{k:02d}{index:04d}. " + (
        SYSTEM_RULES_B
    )


def user_message_b(index: int, turn: int) -> str:
    return f"Message {turn + 1}: {QUESTIONS_B[(index + turn) % len(QUESTIONS_B)]}"


def interleave(base_url: str, spec: ServerSpec, k: int, args: argparse.Namespace) -> list[TurnResult]:
    deadline = time.monotonic() + args.run_timeout
    histories: list[list[ChatCompletionMessageParam]] = [
        [{"role": "system", "content": system_prompt_b(k, index)}] for index in range(k)
    ]
    results: list[TurnResult] = []
    with make_client(base_url) as client:
        warm_up(client, spec.served_model)
        if spec.label == COURIER:
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


def part_b_spec(label: str, model_dir: Path, budget_bytes: int | None, courier_args: Sequence[str]) -> ServerSpec:
    if label == COURIER:
        flags = list(courier_args)
        if budget_bytes is not None:
            flags += ["--prompt-cache-snapshot-capacity-bytes", str(budget_bytes)]
        return ServerSpec(label=COURIER, model_dir=model_dir, flags=tuple(flags))
    flags = ["--log-level", "WARNING"]
    if budget_bytes is not None:
        flags += ["--prompt-cache-bytes", str(budget_bytes), "--prompt-cache-size", str(COURIER_DEFAULT_MAX_ENTRIES)]
    return ServerSpec(label=MLX_LM_F32, model_dir=model_dir, flags=tuple(flags))


def run_interleaved(
    cache_dir: Path,
    *,
    model: str,
    model_dir: Path,
    label: str,
    k: int,
    budget: ByteBudget | None,
    args: argparse.Namespace,
) -> InterleavedRun:
    budget_bytes = budget.capacity_bytes if budget is not None else None
    spec = part_b_spec(label, model_dir, budget_bytes, args.courier_arg)
    budget_name = DEFAULT_BUDGET if budget is None else EQUAL_BUDGET

    def measure(base_url: str) -> tuple[list[TurnResult], dict[str, Any] | None]:
        turns = interleave(base_url, spec, k, args)
        return turns, courier_stats(base_url) if label == COURIER else None

    log_name = f"b-{model}-{label}-{budget_name}-k{k}"
    launch, result = serve_and_measure(spec, cache_dir, log_name, args.openblas, measure)
    turns, stats = result if result is not None else ([], None)
    later = [turn for turn in turns if turn.turn >= 2]
    if stats is not None:
        progress(
            f"{log_name}: entries {stats.get('snapshot_entries')}, "
            f"evictions_lru {stats.get('snapshot_evictions_lru')}, "
            f"self_evictions {stats.get('snapshot_self_evictions')}, "
            f"bytes/entry {stats.get('snapshot_bytes_per_entry')}"
        )
    return InterleavedRun(
        model=model,
        budget=budget_name,
        budget_bytes=budget_bytes,
        conversations=k,
        server=launch,
        cached_share=cached_share(turns),
        ttft_p50_later_s=median_ttft(later),
        ttft_p50_first_s=median_ttft([turn for turn in turns if turn.turn == 1]),
        empty_replies=sum(turn.empty_reply for turn in turns),
        courier_stats=stats,
        turns=turns,
    )


def derive_budget(model: str, default_runs: Sequence[InterleavedRun], args: argparse.Namespace) -> ByteBudget:
    """The equal byte budget: `--budget-bytes`, or a fraction of what Courier held at the largest K."""
    if args.budget_bytes is not None:
        return ByteBudget(model=model, capacity_bytes=args.budget_bytes, explanation="--budget-bytes")
    k = max(args.conversations)
    source = next((run for run in default_runs if run.server.label == COURIER and run.conversations == k), None)
    stats = source.courier_stats if source is not None else None
    if stats is None or not stats.get("snapshot_entries") or not stats.get("snapshot_bytes_per_entry"):
        return ByteBudget(model=model, capacity_bytes=None, explanation=f"no Courier default run at K={k} to size it")
    per_entry, entries = int(stats["snapshot_bytes_per_entry"]), int(stats["snapshot_entries"])
    per_conversation = per_entry * entries / k
    conversations = max(1, round(k * args.budget_fraction))
    capacity = max(1, int(per_conversation * conversations))
    explanation = (
        f"Courier default run at K={k}: {entries} entries x {per_entry} B/entry = {per_conversation:.0f} B per "
        f"conversation; room for {conversations} of {k} conversations"
    )
    return ByteBudget(model=model, capacity_bytes=capacity, explanation=explanation)


def build_tiny_model(model: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    from tests.support.tiny_models import build_llama, build_qwen3_next

    target = cache_dir / "bench-models" / f"tiny-{model}"
    if model == "llama":
        return build_llama(tokenizer_dir, target, quantized=False)
    return build_qwen3_next(tokenizer_dir, target)


def run_part_b(cache_dir: Path, dir4: Path, args: argparse.Namespace) -> tuple[list[InterleavedRun], list[ByteBudget]]:
    runs: list[InterleavedRun] = []
    budgets: list[ByteBudget] = []
    for model in args.b_models:
        model_dir = build_tiny_model(model, dir4, cache_dir)
        progress(f"tiny {model} model: {model_dir}")
        default_runs = [
            run_interleaved(cache_dir, model=model, model_dir=model_dir, label=label, k=k, budget=None, args=args)
            for label in args.b_servers
            for k in args.conversations
        ]
        runs += default_runs
        if args.no_equal_budget:
            continue
        budget = derive_budget(model, default_runs, args)
        budgets.append(budget)
        progress(f"{model}: equal byte budget {budget.capacity_bytes} B ({budget.explanation})")
        if budget.capacity_bytes is None:
            continue
        runs += [
            run_interleaved(cache_dir, model=model, model_dir=model_dir, label=label, k=k, budget=budget, args=args)
            for label in args.b_servers
            for k in args.conversations
        ]
    return runs, budgets


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
        print_part_b(report.interleaved, report.budgets)
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
        f" {ms(median_ttft([t for t in run.turns if t.turn >= 2]))} | | {share_text(cached_share(run.turns))} |"
        for run in runs
    )
    print(f"| p50 / share, turns 2+ |{summary}\n")
    for run in runs:
        if run.courier_stats is not None:
            keys = ("snapshot_entries", "snapshot_hits", "snapshot_lookups", "snapshot_supersedes", "tokens_reused")
            print(
                f"- {run.server.label} cache stats: " + ", ".join(f"{key} {run.courier_stats.get(key)}" for key in keys)
            )
    print()


def courier_cells(stats: dict[str, Any] | None) -> str:
    if stats is None:
        return "- | - | -"
    keys = ("snapshot_entries", "snapshot_evictions_lru", "snapshot_self_evictions")
    return " | ".join(str(stats.get(key, "?")) for key in keys)


def print_part_b(runs: Sequence[InterleavedRun], budgets: Sequence[ByteBudget]) -> None:
    print("### (b) K interleaved conversations, tiny models\n")
    print_launches([run.server for run in runs])
    for budget in budgets:
        print(f"- equal budget for {budget.model}: {budget.capacity_bytes} B ({budget.explanation})")
    print()
    print(
        "| model | budget | K | server | cached share, turns 2+ | TTFT p50 ms, turns 2+ | TTFT p50 ms, turn 1 "
        "| empty replies | courier entries | evictions_lru | self_evictions |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in sorted(runs, key=lambda item: (item.model, item.budget, item.conversations, item.server.label)):
        budget_text = run.budget if run.budget_bytes is None else f"{run.budget} ({run.budget_bytes} B)"
        share = "FAILED" if run.server.error is not None else share_text(run.cached_share)
        print(
            f"| {run.model} | {budget_text} | {run.conversations} | {run.server.label} | {share} "
            f"| {ms(run.ttft_p50_later_s)} | {ms(run.ttft_p50_first_s)} | {run.empty_replies} "
            f"| {courier_cells(run.courier_stats)} |"
        )
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
    add("--a-servers", type=server_list, default=[COURIER, MLX_LM_F32, MLX_LM_4BIT], help="part a servers")
    add("--b-turns", type=int, default=4, help="part b: turns per conversation (4)")
    add("--b-max-tokens", type=int, default=8, help="part b: max_tokens per turn (8)")
    add("--b-models", type=choices(TINY_MODELS), default=list(TINY_MODELS), help="part b models (llama,qwen3_next)")
    add("--b-servers", type=choices(B_SERVERS), default=list(B_SERVERS), help=f"part b servers ({','.join(B_SERVERS)})")
    add("--budget-fraction", type=float, default=0.5, help="part b: equal budget as a share of K conversations (0.5)")
    add("--budget-bytes", type=int, default=None, help="part b: the equal byte budget itself (default: derived)")
    add("--no-equal-budget", action="store_true", help="part b: run the default budgets only")
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
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> dict[str, object]:
    keys = (
        *("parts", "conversations", "turns", "a_max_tokens", "a_servers", "b_turns", "b_max_tokens", "b_models"),
        *("b_servers", "budget_fraction", "budget_bytes", "courier_arg", "store_entries", "store_lookups"),
    )
    return {key: getattr(args, key) for key in keys}


def needs_openblas(args: argparse.Namespace) -> bool:
    return ("a" in args.parts and MLX_LM_F32 in args.a_servers) or ("b" in args.parts and MLX_LM_F32 in args.b_servers)


def run_servers(args: argparse.Namespace) -> tuple[list[ConversationRun], list[InterleavedRun], list[ByteBudget]]:
    """Parts a and b, which share the 4-bit SmolLM2 directory (the tiny models borrow its tokenizer)."""
    if "a" not in args.parts and "b" not in args.parts:
        return [], [], []
    with cache_directory(args.cache_dir) as cache_dir:
        progress("converting the embedded GGUF to a 4-bit MLX directory")
        dir4 = prepare_4bit_dir(cache_dir)
        conversation = run_part_a(cache_dir, dir4, args) if "a" in args.parts else []
        interleaved, budgets = run_part_b(cache_dir, dir4, args) if "b" in args.parts else ([], [])
    return conversation, interleaved, budgets


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if needs_openblas(args) and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or leave out {MLX_LM_F32}")
        return 2
    blas = load_optimized_blas()  # before MLX is imported, as bench.throughput does
    conversation, interleaved, budgets = run_servers(args)
    report = Report(
        environment=environment(blas),
        settings=settings_of(args),
        conversation=conversation,
        interleaved=interleaved,
        budgets=budgets,
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
