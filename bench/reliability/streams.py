"""The parts that stream chat completions: `load` (waves past --max-queue, and single probes while the queue is
full), `disconnects` (clients that close their streams early) and `shutdown` (SIGTERM with streams in flight, and
new requests during the drain)."""

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
    SERVED,
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


@dataclass(slots=True, kw_only=True)
class ShutdownRecord:
    max_tokens: int
    chunks: int = 0
    outcome: str = "not finished"
    error_code: str | None = None
    error_message: str | None = None
    ended_after_sigterm_s: float | None = None


async def shutdown_client(
    client: openai.AsyncOpenAI, record: ShutdownRecord, started: asyncio.Event, sigterm_at: list[float]
) -> None:
    read = Read()
    try:
        await read_chat(client, f"Write {record.max_tokens} words.", record.max_tokens, read, on_chunk=started.set)
        record.outcome = f"completed ({read.finish})" if read.finish else read.outcome
    except openai.APIStatusError as error:
        record.outcome = f"status {status_outcome(error)}"
    except openai.APIConnectionError as error:
        record.outcome = f"connection error: {type(error).__name__}"
    except openai.APIError as error:
        record.outcome, record.error_code = "error event", str(getattr(error, "code", None))
        record.error_message = error.message
    finally:
        record.chunks = read.chunks
        started.set()
        if sigterm_at:
            record.ended_after_sigterm_s = time.monotonic() - sigterm_at[0]


async def drain_probe(http: httpx.AsyncClient) -> str:
    """A new chat completion during the drain, on `http`'s connection (new, or kept alive from before)."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        response = await http.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
    return f"{response.status_code} {code or ''} Retry-After={response.headers.get('retry-after')}"


async def shutdown_traffic(
    server: Server, args: argparse.Namespace
) -> tuple[list[ShutdownRecord], dict[str, str], float]:
    """8 streams (4 short, 4 long); once each has its first chunk, SIGTERM; 0.5 s later a new request on a new
    connection and on one kept alive from before the signal."""
    records = [ShutdownRecord(max_tokens=16 if i < 4 else 1800) for i in range(8)]
    started = [asyncio.Event() for _ in records]
    sigterm_at: list[float] = []
    async with (
        async_client(server.base_url, CLIENT_TIMEOUT_S) as client,
        httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as kept_alive,
    ):
        await kept_alive.get("/health")  # opens the connection the second probe reuses
        tasks = [
            asyncio.create_task(shutdown_client(client, r, e, sigterm_at))
            for r, e in zip(records, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), args.hang_bound)
        sigterm_at.append(time.monotonic())
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        progress("shutdown: SIGTERM with 8 streams in flight")
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as fresh:
            probe = {"new connection": await drain_probe(fresh), "kept-alive connection": await drain_probe(kept_alive)}
        _, pending = await asyncio.wait(tasks, timeout=args.hang_bound)
        for task in pending:
            task.cancel()
    await asyncio.to_thread(server.wait_exit, args.hang_bound)
    return records, probe, time.monotonic() - sigterm_at[0]


def run_shutdown(setup: Setup) -> PartResult:
    args = setup.args
    command = f"bench.reliability --parts shutdown --shutdown-timeout {args.shutdown_timeout:g}"
    result, courier = setup.part("shutdown", command, ["--shutdown-timeout", f"{args.shutdown_timeout:g}"])
    with courier as server:
        records, probe, exit_s = asyncio.run(shutdown_traffic(server, args))
        exit_code = server.wait_exit()
    outcomes = Counter(record.outcome for record in records)
    terminal = all(r.outcome.startswith("completed") or r.outcome == "error event" for r in records)
    bound = args.shutdown_timeout + args.exit_slack
    result.row("streams (max_tokens)", ", ".join(str(r.max_tokens) for r in records))
    result.row("client outcomes", counts(outcomes))
    result.row("error event codes", counts(Counter(r.error_code for r in records if r.error_code)))
    ended = ("n/a" if r.ended_after_sigterm_s is None else f"{r.ended_after_sigterm_s:.2f}" for r in records)
    result.row("streams ended after SIGTERM (s)", ", ".join(ended))
    for connection, outcome in probe.items():
        result.row(f"a new request 0.5 s into the drain ({connection})", outcome)
    result.row("exit code / time to exit (s)", f"{exit_code} / {exit_s:.2f} (bound {bound:g})")
    result.check("every client got a terminal outcome", terminal, counts(outcomes))
    result.check("exit code 0", exit_code == 0, exit_code)
    result.check("exited within --shutdown-timeout + slack", exit_s <= bound, f"{exit_s:.2f} s")
    result.data = {"records": [asdict(record) for record in records], "drain_probe": probe}
    return result
