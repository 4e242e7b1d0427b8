"""Replicas behind HAProxy: conversation affinity against round robin, on the same replicas, in one run.

A cluster as `courier cluster up` starts it (`courier/cluster/local_cluster.py`: a private
PostgreSQL, `--replicas` (3) replicas, an HAProxy front), once with the affinity front and once
with the same front in plain round robin (`--round-robin`), on each tiny random-weight model of
`--models` (a dense llama with a trimmable KV cache, a hybrid qwen3_next whose cache cannot be
trimmed: `tests/support/tiny_models.py`; `smollm2` names the embedded SmolLM2-135M-Instruct, whose
prefill, unlike the tiny models', costs real time). A fresh cluster for each (model, front).

The workload: `--conversations` (16) conversations of `--turns` (8) turns, `--at-once` (16) of
them in flight at once (one client thread each, its turns one after another), every turn a streamed chat
completion through the front with the whole history, `prompt_cache_key` naming the conversation,
temperature 0 and `max_tokens` `--max-tokens` (32). Each conversation has its own system prompt
(a header naming the customer, then about `--system-words` (420) words of a support handbook, the
one bench/multiturn.py part b uses: ~550 tokens) and short questions. Per (model, front):

- the share of turns-2+ prompt tokens served from the cache (sum of `cached_tokens` / sum of
  `prompt_tokens`), the number of replicas each conversation touched, and the turns each replica served;
- TTFT (request sent .. first content delta) p50 and p90 of turns 2+, and of turn 1;
- aggregate decode throughput: completion tokens of all turns / the wall time of the run, and
  the prompt tokens the replicas had to compute (prompt - cached);
- the turn after a kill: replica r1 is killed (SIGKILL) once the turns are done, and every
  conversation sends one more turn at once. Per group (those whose last turn r1 served, the
  rest): turns that failed, TTFT p50 and cached share.

Run from the repository root, alone on the machine (two cores are shared by three replicas,
PostgreSQL, HAProxy and the clients; another job skews every figure):

    .venv/bin/python -m bench.cluster [--models llama,qwen3_next] [--replicas 3] [--conversations 16]
        [--turns 8] [--at-once 16] [--max-tokens 32] [--system-words 420] [--cache-dir DIR] [--json PATH]

Markdown goes to stdout, progress to stderr; the clusters' logs are deleted with them.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.multiturn import build_tiny_model, handbook_words, system_prompt_b, user_message_b
from bench.throughput import prepare_4bit_dir
from courier.cluster.local_cluster import ClusterPlan, LocalCluster

SERVED_NAME = "tiny"
KILLED = "r1"
REQUEST_TIMEOUT_S = 300.0
HEADER = "x-courier-replica"


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    conversation: int
    turn: int  # from 1
    replica: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    error: str | None = None


@dataclass(slots=True, kw_only=True)
class Conversation:
    index: int
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """Some turns summed up."""

    turns: int
    failed: int
    cached_share: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    model: str
    front: str  # "affinity" or "round robin"
    start_s: float
    wall_s: float
    first_turns: Group
    later_turns: Group
    completion_tokens: int
    computed_prompt_tokens: int  # prompt tokens not served from a cache
    decode_tokens_per_s: float
    replicas_per_conversation: list[int]
    turns_per_replica: dict[str, int]
    conversations_on_killed: int
    after_kill_on_killed: Group
    after_kill_others: Group


def progress(text: str) -> None:
    print(f"[bench.cluster] {text}", file=sys.stderr, flush=True)


def stream_turn(http: httpx.Client, conversation: Conversation, turn: int, max_tokens: int) -> Turn:
    """One streamed turn through the front; its reply joins the history."""
    conversation.messages.append({"role": "user", "content": user_message_b(conversation.index, turn - 1)})
    body = {
        "model": SERVED_NAME,
        "messages": conversation.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": f"conversation-{conversation.index}",
    }
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            replica = response.headers.get(HEADER, "?")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line.removeprefix("data: "))
                if "error" in chunk:  # an error after the stream began: the turn failed
                    raise httpx.HTTPError(f"error event: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    if text := choice.get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        pieces.append(text)
    except httpx.HTTPError as error:
        conversation.messages.pop()
        return Turn(
            conversation=conversation.index,
            turn=turn,
            replica="?",
            prompt_tokens=0,
            cached_tokens=0,
            completion_tokens=0,
            ttft_s=time.perf_counter() - sent,
            error=f"{type(error).__name__}: {error}",
        )
    conversation.messages.append({"role": "assistant", "content": "".join(pieces)})
    return Turn(
        conversation=conversation.index,
        turn=turn,
        replica=replica,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        completion_tokens=usage.get("completion_tokens", 0),
        ttft_s=(first or time.perf_counter()) - sent,
    )


def summarize(turns: Sequence[Turn]) -> Group:
    served = [turn for turn in turns if turn.error is None]
    prompt = sum(turn.prompt_tokens for turn in served)
    times = sorted(turn.ttft_s for turn in served)
    return Group(
        turns=len(turns),
        failed=len(turns) - len(served),
        cached_share=sum(turn.cached_tokens for turn in served) / prompt if prompt else None,
        ttft_p50_s=statistics.median(times) if times else None,
        ttft_p90_s=times[min(len(times) - 1, int(0.9 * len(times)))] if times else None,
    )


def run_one(model_dir: Path | None, model: str, affinity: bool, cache_dir: Path, args: argparse.Namespace) -> Run:
    front = "affinity" if affinity else "round robin"
    chosen = () if model_dir is None else ("--model", str(model_dir))  # None: the embedded SmolLM2
    serve = (*chosen, "--cache-dir", str(cache_dir), "--served-model-name", SERVED_NAME)
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("COURIER_", "OTEL_"))}
    plan = ClusterPlan(replicas=args.replicas, port=0, serve_args=serve, affinity=affinity)
    handbook = handbook_words(args.system_words)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as directory:
        started = time.perf_counter()
        with LocalCluster(plan, Path(directory), environ) as cluster:
            start_s = time.perf_counter() - started
            progress(f"{model}, {front}: {args.replicas} replicas up in {start_s:.1f} s at {cluster.url}")
            for replica in cluster.replicas.values():  # each replica's first forward pass, outside the figures
                warm = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
                httpx.post(f"{replica.url}/v1/chat/completions", json=warm, timeout=REQUEST_TIMEOUT_S)
            conversations = [
                Conversation(
                    index=index, messages=[{"role": "system", "content": system_prompt_b(99, index, handbook)}]
                )
                for index in range(args.conversations)
            ]
            with httpx.Client(base_url=cluster.url, timeout=REQUEST_TIMEOUT_S) as http:

                def converse(conversation: Conversation) -> None:
                    for turn in range(1, args.turns + 1):
                        conversation.turns.append(stream_turn(http, conversation, turn, args.max_tokens))

                began = time.perf_counter()
                with ThreadPoolExecutor(min(args.at_once, len(conversations))) as pool:
                    list(pool.map(converse, conversations))
                wall_s = time.perf_counter() - began
                turns = [turn for conversation in conversations for turn in conversation.turns]
                replicas = list(cluster.replicas)
                progress(f"{model}, {front}: {len(turns)} turns in {wall_s:.1f} s; killing {KILLED}")
                on_killed = {c.index for c in conversations if c.turns[-1].replica == KILLED}
                cluster.replicas[KILLED].signal(signal.SIGKILL)
                cluster.replicas[KILLED].wait(30)
                with ThreadPoolExecutor(len(conversations)) as pool:
                    after = list(
                        pool.map(lambda c: stream_turn(http, c, args.turns + 1, args.max_tokens), conversations)
                    )
    completion = sum(turn.completion_tokens for turn in turns)
    return Run(
        model=model,
        front=front,
        start_s=start_s,
        wall_s=wall_s,
        first_turns=summarize([turn for turn in turns if turn.turn == 1]),
        later_turns=summarize([turn for turn in turns if turn.turn >= 2]),
        completion_tokens=completion,
        computed_prompt_tokens=sum(turn.prompt_tokens - turn.cached_tokens for turn in turns),
        decode_tokens_per_s=completion / wall_s,
        replicas_per_conversation=[len({turn.replica for turn in c.turns}) for c in conversations],
        turns_per_replica={name: sum(turn.replica == name for turn in turns) for name in sorted(replicas)},
        conversations_on_killed=len(on_killed),
        after_kill_on_killed=summarize([turn for turn in after if turn.conversation in on_killed]),
        after_kill_others=summarize([turn for turn in after if turn.conversation not in on_killed]),
    )


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def report(runs: Sequence[Run], args: argparse.Namespace) -> str:
    lines = [
        f"{args.conversations} conversations x {args.turns} turns, {min(args.at_once, args.conversations)} at once, "
        "through HAProxy in front of "
        f"{args.replicas} replicas (max_tokens {args.max_tokens}, ~{args.system_words}-word system prompts).",
        "",
        "| model | front | turns-2+ prompt tokens cached | replicas per conversation | TTFT p50 / p90 turns 2+ (ms) "
        "| TTFT p50 turn 1 (ms) | prompt tokens computed | decode tok/s (aggregate) | wall (s) | turns per replica "
        "| failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        later, first = run.later_turns, run.first_turns
        spread = statistics.mean(run.replicas_per_conversation)
        lines.append(
            f"| {run.model} | {run.front} | {percent(later.cached_share)} | {spread:.2f} (max "
            f"{max(run.replicas_per_conversation)}) | {ms(later.ttft_p50_s)} / {ms(later.ttft_p90_s)} | "
            f"{ms(first.ttft_p50_s)} | {run.computed_prompt_tokens} | {run.decode_tokens_per_s:.1f} | "
            f"{run.wall_s:.1f} | {' / '.join(str(count) for count in run.turns_per_replica.values())} | "
            f"{later.failed + first.failed} |"
        )
    lines += [
        "",
        f"The turn after `kill -9` of {KILLED}, every conversation at once:",
        "",
        f"| model | front | conversations last on {KILLED} | their turn: failed, TTFT p50 (ms), cached "
        "| the others: failed, TTFT p50 (ms), cached |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        killed, others = run.after_kill_on_killed, run.after_kill_others
        lines.append(
            f"| {run.model} | {run.front} | {run.conversations_on_killed} | {killed.failed}, "
            f"{ms(killed.ttft_p50_s)}, {percent(killed.cached_share)} | {others.failed}, {ms(others.ttft_p50_s)}, "
            f"{percent(others.cached_share)} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,qwen3_next")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--at-once", type=int, default=16, help="conversations in flight at once (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=420)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "courier-bench-cluster")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    dir4 = prepare_4bit_dir(args.cache_dir)
    runs = []
    for model in args.models.split(","):
        model_dir = None if model == "smollm2" else build_tiny_model(model, dir4, args.cache_dir)
        for affinity in (True, False):
            runs.append(run_one(model_dir, model, affinity, args.cache_dir, args))
    print(report(runs, args))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps([asdict(run) for run in runs], option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
