"""The load part: waves of streams past --max-queue, and single probes while the queue is full."""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import openai

from bench.harness.clients import async_client
from bench.harness.report import counts, progress
from bench.harness.servers import Server
from bench.harness.stats import percentile_or_none
from bench.reliability.common import (
    CLIENT_TIMEOUT_S,
    HTTP_TIMEOUT_S,
    LOAD_MAX_BATCH,
    LOAD_MAX_QUEUE,
    PartResult,
    Read,
    Setup,
    counters_text,
    idle,
    mib,
    p50_p99_max,
    read_chat,
    rss_kib,
    scheduler,
    status_outcome,
    wait_idle,
    words,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRecord:
    wave: int
    outcome: str  # completed, stream ended without finish_reason, 429 queue_full, ..., hung, error: ...
    seconds: float
    chunks: int = 0
    retry_after: str | None = None
    probe: bool = False  # sent alone while the queue was full (not part of the burst)


async def load_client(
    client: openai.AsyncOpenAI, wave: int, prompt: str, max_tokens: int, *, probe: bool = False
) -> LoadRecord:
    sent, read, retry_after = time.perf_counter(), Read(), None
    try:
        await read_chat(client, prompt, max_tokens, read)
        outcome = read.outcome
    except openai.APIStatusError as error:
        outcome, retry_after = status_outcome(error), error.response.headers.get("retry-after")
    except openai.APIError as error:
        outcome = f"error: {type(error).__name__}: {error}"
    seconds = time.perf_counter() - sent
    return LoadRecord(
        wave=wave, outcome=outcome, retry_after=retry_after, seconds=seconds, chunks=read.chunks, probe=probe
    )


async def bounded(coroutine: Any, bound: float, wave: int) -> LoadRecord:
    try:
        result: LoadRecord = await asyncio.wait_for(coroutine, bound)
        return result
    except TimeoutError:
        return LoadRecord(wave=wave, outcome="hung", seconds=bound)


async def load_waves(server: Server, args: argparse.Namespace) -> list[LoadRecord]:
    """Waves of concurrent streams; in each, once /health shows the queue full (at most 30 s), probes one at a time."""
    rng, records = random.Random(args.seed), []
    async with (
        async_client(server.base_url, CLIENT_TIMEOUT_S) as client,
        httpx.AsyncClient(base_url=server.base_url) as http,
    ):
        await load_client(client, -1, "warm up", 8)
        for wave in range(args.load_waves):
            progress(f"load: wave {wave + 1}/{args.load_waves}, {args.load_clients} clients")
            prompts = [f"Client {i}: {words(rng, 12)}" for i in range(args.load_clients)]
            burst = asyncio.gather(
                *(bounded(load_client(client, wave, p, args.load_max_tokens), args.hang_bound, wave) for p in prompts)
            )
            for _ in range(300):
                if (await http.get("/health", timeout=HTTP_TIMEOUT_S)).json()["scheduler"]["waiting"] >= LOAD_MAX_QUEUE:
                    for index in range(args.load_probes):
                        probe = load_client(client, wave, f"Probe {index}", args.load_max_tokens, probe=True)
                        records.append(await bounded(probe, args.hang_bound, wave))
                    break
                await asyncio.sleep(0.1)
            records += await burst
    return records


def run_load(setup: Setup) -> PartResult:
    args = setup.args
    result, courier = setup.part(
        "load",
        "bench.reliability --parts load",
        ["--max-batch", str(LOAD_MAX_BATCH), "--max-queue", str(LOAD_MAX_QUEUE)],
    )
    with courier as server:
        rss_before, before = rss_kib(server.pid), scheduler(server)
        records = asyncio.run(load_waves(server, args))
        rss_after = rss_kib(server.pid)
        first, after, idle_s = wait_idle(server)
        exit_code = server.stop(signal.SIGTERM)
    outcomes = Counter(record.outcome for record in records if not record.probe)
    probe_outcomes = Counter(record.outcome for record in records if record.probe)
    refusals = [r for r in records if r.outcome.startswith(("429", "503"))]
    completed = [r.seconds for r in records if r.outcome == "completed"]
    missing_retry = sum(1 for r in refusals if not r.retry_after)
    unexpected = [r for r in records if r.outcome != "completed" and r not in refusals]
    slowest = max((r.seconds for r in records), default=0.0)
    rejected = after["rejected"] - before["rejected"]
    result.row("waves x clients (max_tokens)", f"{args.load_waves} x {args.load_clients} ({args.load_max_tokens})")
    result.row("outcomes", counts(outcomes))
    result.row("probes sent alone while the queue was full", counts(probe_outcomes))
    result.row("refusals with Retry-After (burst and probes)", f"{len(refusals) - missing_retry} / {len(refusals)}")
    result.row(
        "time to refusal in the burst p50 / p99 / max (ms)", p50_p99_max([r.seconds for r in refusals if not r.probe])
    )
    result.row("time to refusal of a probe p50 / p99 / max (ms)", p50_p99_max([r.seconds for r in refusals if r.probe]))
    result.row(
        "time to complete p50 / max (s)",
        f"{percentile_or_none(completed, 0.5) or 0:.2f} / {max(completed, default=0):.2f}",
    )
    result.row("slowest client (s)", f"{slowest:.2f} (bound {args.hang_bound:.0f})")
    result.row("server RSS before / after (MiB)", f"{mib(rss_before)} / {mib(rss_after)}")
    result.row("/health after (immediately)", counters_text(first))
    result.row("/health after (idle)", f"{counters_text(after)} (after {idle_s:.1f} s)")
    result.row("exit code after SIGTERM", exit_code)
    result.check("no client hung", outcomes["hung"] == 0 and slowest < args.hang_bound, f"slowest {slowest:.2f} s")
    result.check("every outcome is a completed stream or a 429/503", not unexpected, counts(outcomes))
    result.check("some requests were refused and some completed", bool(refusals) and bool(completed))
    result.check("every refusal carries Retry-After", missing_retry == 0, f"{missing_retry} without")
    result.check("running == waiting == 0 after", idle(first), counters_text(first))
    result.check(
        "rejected counter == refusals", rejected == len(refusals), f"rejected +{rejected}, refusals {len(refusals)}"
    )
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    result.data = {"records": [asdict(record) for record in records], "health_before": before}
    return result
