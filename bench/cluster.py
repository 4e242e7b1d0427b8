"""Replicas behind HAProxy: conversation affinity against round robin, on the same replicas, in one run, and the
turn after a replica is killed."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from bench.harness import cli
from bench.harness.clients import Messages, async_client, stream_chat
from bench.harness.models import TINY_MODELS, prepare_4bit_dir, tiny_model
from bench.harness.report import ms, percent, progress, table, write_json
from bench.harness.stats import median_or_none, percentile_or_none, share
from bench.multiturn import handbook_words, system_prompt_b, user_message_b
from courier.cluster.local_cluster import ClusterPlan, LocalCluster

SERVED_NAME = "tiny"
KILLED = "r1"
REQUEST_TIMEOUT_S = 300.0
HEADER = "x-courier-replica"


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    conversation: int
    turn: int  # from 1
    ttft_s: float
    replica: str = "?"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(slots=True, kw_only=True)
class Conversation:
    index: int
    messages: Messages = field(default_factory=list)
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


async def take_turn(client: openai.AsyncOpenAI, conversation: Conversation, turn: int, max_tokens: int) -> Turn:
    """One streamed turn through the front, `prompt_cache_key` naming the conversation; its reply joins the
    history (a failed turn leaves it as it was)."""
    conversation.messages.append({"role": "user", "content": user_message_b(conversation.index, turn - 1)})
    sent = time.perf_counter()
    try:
        reply = await stream_chat(
            client,
            SERVED_NAME,
            conversation.messages,
            max_tokens=max_tokens,
            keep_headers=(HEADER,),
            prompt_cache_key=f"conversation-{conversation.index}",
        )
    except openai.APIError as error:  # an error event after the stream began fails the turn too
        conversation.messages.pop()
        failed = f"{type(error).__name__}: {error}"
        return Turn(conversation=conversation.index, turn=turn, ttft_s=time.perf_counter() - sent, error=failed)
    conversation.messages.append({"role": "assistant", "content": reply.text})
    return Turn(
        conversation=conversation.index,
        turn=turn,
        replica=reply.headers[HEADER],
        prompt_tokens=reply.prompt_tokens or 0,
        cached_tokens=reply.cached_tokens or 0,
        completion_tokens=reply.completion_tokens,
        ttft_s=reply.ttft_s,
    )


def summarize(turns: Sequence[Turn]) -> Group:
    served = [turn for turn in turns if turn.error is None]
    times = [turn.ttft_s for turn in served]
    return Group(
        turns=len(turns),
        failed=len(turns) - len(served),
        cached_share=share(sum(turn.cached_tokens for turn in served), sum(turn.prompt_tokens for turn in served)),
        ttft_p50_s=median_or_none(times),
        ttft_p90_s=percentile_or_none(times, 0.90),
    )


async def converse(
    cluster: LocalCluster, conversations: list[Conversation], args: argparse.Namespace
) -> tuple[float, set[int], list[Turn]]:
    """Every conversation's turns, `--at-once` conversations in flight; then a kill of KILLED and one more turn of
    every conversation at once. The wall time, the conversations whose last turn KILLED served, the turns after."""
    async with async_client(cluster.url, REQUEST_TIMEOUT_S) as client:
        gate = asyncio.Semaphore(min(args.at_once, len(conversations)))

        async def one(conversation: Conversation) -> None:
            async with gate:
                for turn in range(1, args.turns + 1):
                    conversation.turns.append(await take_turn(client, conversation, turn, args.max_tokens))

        began = time.perf_counter()
        await asyncio.gather(*(one(conversation) for conversation in conversations))
        wall_s = time.perf_counter() - began
        progress(f"{sum(len(c.turns) for c in conversations)} turns in {wall_s:.1f} s; killing {KILLED}")
        on_killed = {c.index for c in conversations if c.turns[-1].replica == KILLED}
        cluster.replicas[KILLED].signal(signal.SIGKILL)
        cluster.replicas[KILLED].wait(30)
        after = [take_turn(client, c, args.turns + 1, args.max_tokens) for c in conversations]
        return wall_s, on_killed, list(await asyncio.gather(*after))


def run_one(model_dir: Path | None, model: str, affinity: bool, cache_dir: Path, args: argparse.Namespace) -> Run:
    """A fresh cluster as `courier cluster up` starts it, with the affinity front or plain round robin."""
    front = "affinity" if affinity else "round robin"
    chosen = () if model_dir is None else ("--model", str(model_dir))  # None: the embedded SmolLM2
    serve = (*chosen, "--cache-dir", str(cache_dir), "--served-model-name", SERVED_NAME)
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("COURIER_", "OTEL_"))}
    plan = ClusterPlan(replicas=args.replicas, port=0, serve_args=serve, affinity=affinity)
    handbook = handbook_words(args.system_words)
    conversations = [
        Conversation(index=index, messages=[{"role": "system", "content": system_prompt_b(99, index, handbook)}])
        for index in range(args.conversations)
    ]
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as directory:
        started = time.perf_counter()
        with LocalCluster(plan, Path(directory), environ) as cluster:
            start_s = time.perf_counter() - started
            progress(f"{model}, {front}: {args.replicas} replicas up in {start_s:.1f} s at {cluster.url}")
            for replica in cluster.replicas.values():  # each replica's first forward pass, outside the figures
                warm = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
                httpx.post(f"{replica.url}/v1/chat/completions", json=warm, timeout=REQUEST_TIMEOUT_S)
            replicas = sorted(cluster.replicas)
            wall_s, on_killed, after = asyncio.run(converse(cluster, conversations, args))
    turns = [turn for conversation in conversations for turn in conversation.turns]
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
        turns_per_replica={name: sum(turn.replica == name for turn in turns) for name in replicas},
        conversations_on_killed=len(on_killed),
        after_kill_on_killed=summarize([turn for turn in after if turn.conversation in on_killed]),
        after_kill_others=summarize([turn for turn in after if turn.conversation not in on_killed]),
    )


def print_report(runs: Sequence[Run], args: argparse.Namespace) -> None:
    print(
        f"{args.conversations} conversations x {args.turns} turns, {min(args.at_once, args.conversations)} at once, "
        f"through HAProxy in front of {args.replicas} replicas (max_tokens {args.max_tokens}, "
        f"~{args.system_words}-word system prompts).\n"
    )
    table(
        "model | front | turns-2+ prompt tokens cached | replicas per conversation | TTFT p50 / p90 turns 2+ (ms) "
        "| TTFT p50 turn 1 (ms) | prompt tokens computed | decode tok/s (aggregate) | wall (s) | turns per replica "
        "| failed",
        (
            f"{run.model} | {run.front} | {percent(run.later_turns.cached_share, missing='-')} "
            f"| {statistics.mean(run.replicas_per_conversation):.2f} (max {max(run.replicas_per_conversation)}) "
            f"| {ms(run.later_turns.ttft_p50_s, 0, '-')} / {ms(run.later_turns.ttft_p90_s, 0, '-')} "
            f"| {ms(run.first_turns.ttft_p50_s, 0, '-')} | {run.computed_prompt_tokens} "
            f"| {run.decode_tokens_per_s:.1f} | {run.wall_s:.1f} "
            f"| {' / '.join(str(count) for count in run.turns_per_replica.values())} "
            f"| {run.later_turns.failed + run.first_turns.failed}"
            for run in runs
        ),
    )
    print(f"The turn after `kill -9` of {KILLED}, every conversation at once:\n")

    def group(turns: Group) -> str:
        return f"{turns.failed}, {ms(turns.ttft_p50_s, 0, '-')}, {percent(turns.cached_share, missing='-')}"

    table(
        f"model | front | conversations last on {KILLED} | their turn: failed, TTFT p50 (ms), cached "
        "| the others: failed, TTFT p50 (ms), cached",
        (
            f"{run.model} | {run.front} | {run.conversations_on_killed} | {group(run.after_kill_on_killed)} "
            f"| {group(run.after_kill_others)}"
            for run in runs
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--models", type=cli.names((*TINY_MODELS, "smollm2")), default=list(TINY_MODELS), help="llama,qwen3_next")
    add("--replicas", type=cli.positive_int, default=3, help="replicas behind the front (3)")
    add("--conversations", type=cli.positive_int, default=16, help="conversations (16)")
    add("--turns", type=cli.positive_int, default=8, help="turns per conversation (8)")
    add("--at-once", type=cli.positive_int, default=16, help="conversations in flight at once (16)")
    add("--max-tokens", type=int, default=32, help="max_tokens per turn (32)")
    add("--system-words", type=int, default=420, help="handbook words in each system prompt (420: ~550 tokens)")
    cli.add_results(parser)
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or Path(tempfile.gettempdir()) / "courier-bench-cluster"
    dir4 = prepare_4bit_dir(cache_dir)
    runs = []
    for model in args.models:
        model_dir = None if model == "smollm2" else tiny_model(model, dir4, cache_dir)
        runs += [run_one(model_dir, model, affinity, cache_dir, args) for affinity in (True, False)]
    print_report(runs, args)
    write_json(runs, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
