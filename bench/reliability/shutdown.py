"""The shutdown part: SIGTERM with streams in flight, and new requests during the drain."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx
import openai

from bench.harness.clients import async_client
from bench.harness.report import counts, progress
from bench.harness.servers import Server
from bench.reliability.common import (
    CLIENT_TIMEOUT_S,
    SERVED,
    PartResult,
    Read,
    Setup,
    read_chat,
    status_outcome,
)


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
