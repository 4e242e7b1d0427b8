"""The disconnects part: clients that close their streams early."""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass

import openai

from bench.harness.clients import async_client
from bench.harness.report import counts
from bench.harness.servers import Server
from bench.reliability.common import (
    CLIENT_TIMEOUT_S,
    PartResult,
    Read,
    Setup,
    counters_text,
    idle,
    mib,
    read_chat,
    rss_kib,
    scheduler,
    status_outcome,
    wait_idle,
    words,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DisconnectRecord:
    plan: str  # "before first chunk", "after k chunks", "read to end"
    planned_chunks: int | None
    chunks: int
    outcome: str  # disconnected, completed, or an error


async def disconnect_client(
    client: openai.AsyncOpenAI, gate: asyncio.Semaphore, prompt: str, planned: int | None, max_tokens: int
) -> DisconnectRecord:
    """A stream closed after `planned` chunks (0: before the first; None: read to its end)."""
    plan = "read to end" if planned is None else ("before first chunk" if planned == 0 else "after k chunks")
    read = Read()
    async with gate:
        try:
            closed = await read_chat(client, prompt, max_tokens, read, close_after=planned)
            early = read.finish is None or planned == 0
            outcome = ("disconnected" if early else "completed before disconnect") if closed else read.outcome
        except openai.APIStatusError as error:
            outcome = status_outcome(error)
        except openai.APIError as error:
            outcome = f"error: {type(error).__name__}: {error}"
    return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=read.chunks, outcome=outcome)


async def disconnect_traffic(server: Server, args: argparse.Namespace) -> list[DisconnectRecord]:
    """Each client closes after k chunks: k = 0 for 15%, 1..--disconnect-max-chunks for 75%; 10% read to the end."""
    rng = random.Random(args.seed)
    plans = []
    for _ in range(args.disconnect_requests):
        draw = rng.random()
        plans.append(0 if draw < 0.15 else rng.randint(1, args.disconnect_max_chunks) if draw < 0.90 else None)
    prompts = [f"Request {i}: {words(rng, 12)}" for i in range(args.disconnect_requests)]
    gate = asyncio.Semaphore(8)
    async with async_client(server.base_url, CLIENT_TIMEOUT_S) as client:
        jobs = [
            disconnect_client(client, gate, p, plan, args.disconnect_max_tokens)
            for p, plan in zip(prompts, plans, strict=True)
        ]
        return list(await asyncio.gather(*jobs))


def run_disconnects(setup: Setup) -> PartResult:
    args = setup.args
    result, courier = setup.part("disconnects", "bench.reliability --parts disconnects")
    with courier as server:
        before, rss_before = scheduler(server), rss_kib(server.pid)
        records = asyncio.run(disconnect_traffic(server, args))
        first, after, idle_s = wait_idle(server)
        time.sleep(1.0)  # the counters of a request that ends as the clients finish settle within a step
        settled, rss_after = scheduler(server), rss_kib(server.pid)
        exit_code = server.stop(signal.SIGTERM)
    plans = Counter(record.plan for record in records)
    outcomes = Counter(record.outcome for record in records)
    early = outcomes["disconnected"]
    finished = outcomes["completed"] + outcomes["completed before disconnect"]
    delta = {key: settled[key] - before[key] for key in ("completed", "cancelled", "failed", "rejected")}
    errors = {
        key: n for key, n in outcomes.items() if key not in ("disconnected", "completed", "completed before disconnect")
    }
    result.row("requests (max_tokens, concurrency)", f"{len(records)} ({args.disconnect_max_tokens}, 8)")
    result.row("plans", counts(plans))
    result.row("client outcomes", counts(outcomes))
    result.row("/health delta", " ".join(f"{key}=+{value}" for key, value in delta.items()))
    result.row("/health after (immediately)", counters_text(first))
    result.row("/health after (idle, +1 s)", f"{counters_text(settled)} (idle after {idle_s:.1f} s)")
    result.row("server RSS before / after (MiB)", f"{mib(rss_before)} / {mib(rss_after)}")
    result.row("exit code after SIGTERM", exit_code)
    result.check("every client ended (no errors)", not errors, counts(errors))
    result.check("running == waiting == 0 after", idle(after), counters_text(after))
    result.check(
        "cancelled grew by the early disconnects",
        delta["cancelled"] == early,
        f"cancelled +{delta['cancelled']}, early disconnects {early}",
    )
    result.check(
        "completed grew by the streams read to their end",
        delta["completed"] == finished,
        f"completed +{delta['completed']}, finished streams {finished}",
    )
    result.check("no failures", delta["failed"] == 0, f"failed +{delta['failed']}")
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    result.data = {"records": [asdict(record) for record in records], "health_before": before}
    return result
