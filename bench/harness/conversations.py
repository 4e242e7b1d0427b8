"""Conversations under measure: a turn (one streamed chat completion with its place in a conversation), the shares
of prompt tokens a cache served, and Courier's prompt cache over HTTP (its stats, a reset, waiting until idle)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from bench.harness.clients import Messages, Streamed, stream_chat
from bench.harness.servers import BenchmarkError, Server
from bench.harness.stats import median_or_none, share

GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": re-rendered with the reply, so a warm turn may redo it
IDLE_POLL_S = 0.2
IDLE_TIMEOUT_S = 300.0
# Counters that move while Courier still works for its cache between requests: warm-ups, inserts, disk writes.
IDLE_COUNTERS = (
    *("snapshot_warmups_queued", "snapshot_warmups_run", "snapshot_warmups_skipped", "snapshot_inserts"),
    *("snapshot_disk_writes", "snapshot_disk_writes_skipped"),
)


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


def check_deadline(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise BenchmarkError(f"{what}: stopped after the --run-timeout")


def courier_stats(server: Server) -> dict[str, Any]:
    """Courier's /v1/cache/stats."""
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
