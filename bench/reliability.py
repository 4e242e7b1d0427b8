"""Reliability of Courier under load and faults: overload, disconnects, a soak, `kill -9` and SIGTERM.

Every part starts its own `courier serve` (tests/support/server.py's `running_server`: a free port, ready when
the log says so) on a tiny random-weight llama built by tests/support/tiny_models.py (fast on any CPU; the
embedded SmolLM2 conversion lends it its tokenizer), drives it with the official `openai` client
(`max_retries=0`) and checks invariants. Parts, selected with `--parts` (all by default):

- `load`: `--max-batch 4 --max-queue 16`; `--load-waves` (3) waves of `--load-clients` (64) concurrent streaming
  chat completions of `--load-max-tokens` (64) tokens. Per request: the outcome (a stream that ended with a
  `finish_reason`, or a 429/503 refusal and whether it carried `Retry-After`), the time to the refusal or to the
  end of the stream. A client not done within `--hang-bound` (120 s) counts as hung. In each wave, once
  `/health` shows the queue full, `--load-probes` (20) more requests go one at a time: their time to refusal
  is the server's, without the burst's own client-side cost (64 requests built and sent by one Python process
  on the same CPUs). Reported: outcomes, refusal p50/p99 ms (burst and probes), the server's RSS
  (`/proc/PID/status` VmRSS) before and after, `/health` counters after.
- `disconnects`: `--disconnect-requests` (200) streaming chat completions of `--disconnect-max-tokens` (256), 8
  at a time; each client (seeded RNG, `--seed`) closes its connection after k received chunks: k = 0 (before
  the first chunk) for 15%, k in 1..`--disconnect-max-chunks` (32) for 75%, and 10% read to the end. After:
  `/health` running == waiting == 0 and `cancelled` grew by the early disconnects (completed by the others).
- `soak`: `--soak-seconds` (180) of mixed traffic from 5 client threads: chat completions (streamed and not,
  multi-turn, one `user` per conversation) x2, Responses `previous_response_id` chains, Responses in a
  conversation (POST /v1/conversations first; every other turn streamed) and explicit compaction
  (`POST /v1/responses/compact`, `max_output_tokens` 32: on random weights the summary never ends, so 422
  `compaction_failed` is the expected answer). The server gets `--prompt-cache-snapshot-capacity-bytes`
  `--soak-snapshot-capacity` (4MiB, about 17 snapshots of a 460-token state on this model, so it evicts).
  Every `--sample-every` (2) s: RSS, `/v1/cache/stats` snapshot_bytes vs snapshot_capacity_bytes, `/health`
  running/waiting, MLX memory and glibc malloc's bytes in use and freed-but-held. Failures: any 5xx, stream
  errors, connection errors; 4xx other than that 422 `compaction_failed` are counted apart. At the end: running ==
  waiting == 0, RSS growth from the sample nearest 60 s to the last.
- `kill`: `--data-dir D`; 4 client threads create stored Responses (`max_output_tokens` 8; two of them chain
  with `previous_response_id`) and record every id answered with 200 and a body; after `--kill-after` (10) s
  the server gets SIGKILL mid-traffic. A copy of D taken right after the kill gets `PRAGMA integrity_check`;
  the server restarts on D and every acknowledged id must come back from GET /v1/responses/{id} with equal
  status and output; after it stops, D gets `PRAGMA integrity_check` again.
- `shutdown`: `--shutdown-timeout` (5) s; 8 streaming chat completions (4 of 16 tokens, 4 of 1800); once
  every stream has its first chunk, SIGTERM. Every client must get a terminal outcome (a stream that ended
  with a `finish_reason`, or one that ended with an error event), and the process must exit with 0 within
  the shutdown timeout + `--exit-slack` (5) s. A new request 0.5 s into the drain, on a new connection and on
  one kept alive from before the signal, is reported too.

From the repository root:

    .venv/bin/python -m bench.reliability [--parts load,disconnects,soak,kill,shutdown] [--soak-seconds 180]
        [--cache-dir DIR] [--log-dir DIR] [--json PATH]

A markdown summary goes to stdout, progress to stderr; server logs to `--log-dir` (default: CACHE/bench-logs).
Exit code 1 when any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputItemParam

from bench.multiturn import build_tiny_model, choices
from bench.throughput import cache_directory, environment, percentile, prepare_4bit_dir, progress
from courier.platform.blas import load_optimized_blas
from tests.support.server import RunningServer, running_server, server_command

PARTS = ("load", "disconnects", "soak", "kill", "shutdown")
SERVED = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[1]
HTTP_TIMEOUT_S = 30.0
IDLE_WAIT_S = 15.0
CLIENT_TIMEOUT_S = 300.0
LOAD_MAX_BATCH = 4
LOAD_MAX_QUEUE = 16
EXPECTED_COMPACT_OUTCOME = "422 compaction_failed"  # a soak compaction: random weights never end a summary
WORDS = (
    "apple", "river", "stone", "cloud", "lamp", "forest", "window", "bridge", "candle", "harbor", "meadow",
    "engine", "garden", "silver", "thunder", "paper", "violin", "desert", "comet", "lantern", "orbit", "pepper",
    "marble", "canyon", "falcon", "willow", "copper", "ember", "glacier", "kettle", "saddle", "tunnel", "walnut",
    "beacon", "quartz", "ribbon", "lagoon", "spindle", "cobalt",
)  # fmt: skip

T = TypeVar("T")


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(slots=True, kw_only=True)
class PartResult:
    """One part: the server it ran against, a table of figures, the checks, and raw data for the JSON."""

    name: str
    command: str
    server_commands: list[str]
    rows: list[tuple[str, str]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def row(self, metric: str, value: object) -> None:
        self.rows.append((metric, str(value)))

    def check(self, name: str, passed: bool, detail: object = "") -> None:
        self.checks.append(Check(name=name, passed=passed, detail=str(detail)))

    @property
    def passed(self) -> bool:
        return self.error is None and all(check.passed for check in self.checks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    source: dict[str, object]
    settings: dict[str, object]
    parts: list[PartResult]


# ---------------------------------------------------------------- the server and its probes


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    model_dir: Path
    cache_dir: Path
    log_dir: Path
    args: argparse.Namespace


def server_args(setup: Setup, flags: Sequence[str]) -> list[str]:
    return ["--model", str(setup.model_dir), "--served-model-name", SERVED, "--cache-dir", str(setup.cache_dir), *flags]


def command_text(setup: Setup, flags: Sequence[str]) -> str:
    """The server command line as run (a free port instead of 0 makes no difference)."""
    return shlex.join(server_command(server_args(setup, flags)))


@contextmanager
def courier(setup: Setup, flags: Sequence[str], log_name: str) -> Iterator[RunningServer]:
    """A ready server; its log is written to the log directory when the block ends."""
    log_path = setup.log_dir / f"reliability-{log_name}.log"
    progress(f"{log_name}: starting {command_text(setup, flags)} (log: {log_path})")
    with running_server(server_args(setup, flags)) as server:
        progress(f"{log_name}: ready at {server.base_url} (pid {server.process.pid})")
        try:
            yield server
        finally:
            log_path.write_text(server.log())


def rss_kib(pid: int) -> int | None:
    """VmRSS of a live process in KiB (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def get_json(server: RunningServer, path: str) -> dict[str, Any]:
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        body: dict[str, Any] = http.get(path).json()
        return body


def scheduler(server: RunningServer) -> dict[str, Any]:
    counters: dict[str, Any] = get_json(server, "/health")["scheduler"]
    return counters


def wait_idle(server: RunningServer) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The scheduler counters at once, then once running == waiting == 0 (or after IDLE_WAIT_S), and the wait."""
    started = time.monotonic()
    first = scheduler(server)
    last = first
    while (last["running"] or last["waiting"]) and time.monotonic() - started < IDLE_WAIT_S:
        time.sleep(0.2)
        last = scheduler(server)
    return first, last, time.monotonic() - started


def async_client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def sync_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def status_outcome(error: openai.APIStatusError) -> str:
    return f"{error.status_code} {error.code or ''}".strip()


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def pct(values: Sequence[float], fraction: float) -> float | None:
    return percentile(values, fraction) if values else None


def counts_text(counter: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in sorted(counter.items())) or "none"


def stop_and_exit_code(server: RunningServer) -> int:
    """SIGTERM, then the exit code (the part's clean stop, checked by every part)."""
    return server.stop(signal.SIGTERM)


# ---------------------------------------------------------------- part: load


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRecord:
    wave: int
    outcome: str  # completed, stream ended without finish_reason, 429 queue_full, ..., hung, error: ...
    retry_after: str | None
    seconds: float
    chunks: int
    probe: bool = False  # sent alone while the queue was full (not part of the burst)


async def load_client(
    client: openai.AsyncOpenAI, wave: int, prompt: str, max_tokens: int, *, probe: bool = False
) -> LoadRecord:
    sent = time.perf_counter()
    chunks = 0
    finish: str | None = None
    try:
        stream = await client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            stream=True,
        )
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
    except openai.APIStatusError as error:
        retry_after = error.response.headers.get("retry-after")
        return LoadRecord(
            wave=wave,
            outcome=status_outcome(error),
            retry_after=retry_after,
            seconds=time.perf_counter() - sent,
            chunks=chunks,
            probe=probe,
        )
    except openai.APIError as error:
        outcome = f"error: {type(error).__name__}: {error}"
        seconds = time.perf_counter() - sent
        return LoadRecord(wave=wave, outcome=outcome, retry_after=None, seconds=seconds, chunks=chunks, probe=probe)
    outcome = "completed" if finish is not None else "stream ended without finish_reason"
    seconds = time.perf_counter() - sent
    return LoadRecord(wave=wave, outcome=outcome, retry_after=None, seconds=seconds, chunks=chunks, probe=probe)


async def bounded(coroutine: Any, bound: float, wave: int) -> LoadRecord:
    try:
        result: LoadRecord = await asyncio.wait_for(coroutine, bound)
        return result
    except TimeoutError:
        return LoadRecord(wave=wave, outcome="hung", retry_after=None, seconds=bound, chunks=0)


async def load_waves(server: RunningServer, args: argparse.Namespace) -> list[LoadRecord]:
    rng = random.Random(args.seed)
    records: list[LoadRecord] = []
    async with async_client(server) as client:
        await load_client(client, -1, "warm up", 8)
        for wave in range(args.load_waves):
            progress(f"load: wave {wave + 1}/{args.load_waves}, {args.load_clients} clients")
            prompts = [f"Client {i}: {words(rng, 12)}" for i in range(args.load_clients)]
            coroutines = [load_client(client, wave, prompt, args.load_max_tokens) for prompt in prompts]
            burst = asyncio.gather(*(bounded(c, args.hang_bound, wave) for c in coroutines))
            if await queue_full(server, LOAD_MAX_QUEUE):
                for index in range(args.load_probes):
                    probe = load_client(client, wave, f"Probe {index}", args.load_max_tokens, probe=True)
                    records.append(await bounded(probe, args.hang_bound, wave))
            records += await burst
    return records


async def queue_full(server: RunningServer, max_queue: int) -> bool:
    """Wait (at most 30 s) until /health shows the waiting queue full."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as http:
        for _ in range(300):
            counters = (await http.get("/health")).json()["scheduler"]
            if counters["waiting"] >= max_queue:
                return True
            await asyncio.sleep(0.1)
    return False


def run_load(setup: Setup) -> PartResult:
    args = setup.args
    flags = ["--max-batch", str(LOAD_MAX_BATCH), "--max-queue", str(LOAD_MAX_QUEUE)]
    result = PartResult(
        name="load",
        command="bench.reliability --parts load",
        server_commands=[command_text(setup, flags)],
    )
    with courier(setup, flags, "load") as server:
        pid = server.process.pid
        rss_before = rss_kib(pid)
        before = scheduler(server)
        records = asyncio.run(load_waves(server, args))
        rss_after = rss_kib(pid)
        first, after, idle_s = wait_idle(server)
        exit_code = stop_and_exit_code(server)
    outcomes = Counter(record.outcome for record in records if not record.probe)
    probe_outcomes = Counter(record.outcome for record in records if record.probe)
    refusals = [r for r in records if r.outcome.startswith(("429", "503"))]
    completed = [r for r in records if r.outcome == "completed"]
    refusal_s = [r.seconds for r in refusals if not r.probe]
    probe_s = [r.seconds for r in refusals if r.probe]
    complete_s = [r.seconds for r in completed]
    missing_retry = sum(1 for r in refusals if not r.retry_after)
    unexpected = [r for r in records if r.outcome != "completed" and r not in refusals]
    slowest = max((r.seconds for r in records), default=0.0)
    result.row("waves x clients (max_tokens)", f"{args.load_waves} x {args.load_clients} ({args.load_max_tokens})")
    result.row("outcomes", counts_text(outcomes))
    result.row("probes sent alone while the queue was full", counts_text(probe_outcomes))
    result.row("refusals with Retry-After (burst and probes)", f"{len(refusals) - missing_retry} / {len(refusals)}")
    result.row(
        "time to refusal in the burst p50 / p99 / max (ms)",
        f"{ms(pct(refusal_s, 0.5))} / {ms(pct(refusal_s, 0.99))} / {ms(max(refusal_s, default=None))}",
    )
    result.row(
        "time to refusal of a probe p50 / p99 / max (ms)",
        f"{ms(pct(probe_s, 0.5))} / {ms(pct(probe_s, 0.99))} / {ms(max(probe_s, default=None))}",
    )
    result.row("time to complete p50 / max (s)", f"{pct(complete_s, 0.5) or 0:.2f} / {max(complete_s, default=0):.2f}")
    result.row("slowest client (s)", f"{slowest:.2f} (bound {args.hang_bound:.0f})")
    result.row("server RSS before / after (MiB)", f"{mib(rss_before)} / {mib(rss_after)}")
    result.row("/health after (immediately)", counters_text(first))
    result.row("/health after (idle)", f"{counters_text(after)} (after {idle_s:.1f} s)")
    result.row("exit code after SIGTERM", exit_code)
    result.check("no client hung", outcomes["hung"] == 0 and slowest < args.hang_bound, f"slowest {slowest:.2f} s")
    result.check("every outcome is a completed stream or a 429/503", not unexpected, counts_text(outcomes))
    result.check("some requests were refused and some completed", bool(refusals) and bool(completed))
    result.check("every refusal carries Retry-After", missing_retry == 0, f"{missing_retry} without")
    result.check("running == waiting == 0 after", idle(first), counters_text(first))
    result.check(
        "rejected counter == refusals",
        after["rejected"] - before["rejected"] == len(refusals),
        f"rejected +{after['rejected'] - before['rejected']}, refusals {len(refusals)}",
    )
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    result.data = {
        "settings": {"waves": args.load_waves, "clients": args.load_clients, "max_tokens": args.load_max_tokens},
        "outcomes": dict(outcomes),
        "probe_outcomes": dict(probe_outcomes),
        "refusal_ms": {"p50": ms(pct(refusal_s, 0.5)), "p99": ms(pct(refusal_s, 0.99))},
        "probe_refusal_ms": {"p50": ms(pct(probe_s, 0.5)), "p99": ms(pct(probe_s, 0.99))},
        "rss_kib": {"before": rss_before, "after": rss_after},
        "health_before": before,
        "health_after_immediately": first,
        "health_after_idle": after,
        "exit_code": exit_code,
        "records": [asdict(record) for record in records],
    }
    return result


def mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def idle(counters: dict[str, Any]) -> bool:
    return bool(counters["running"] == 0 and counters["waiting"] == 0)


def counters_text(counters: dict[str, Any]) -> str:
    keys = ("running", "waiting", "completed", "cancelled", "failed", "rejected")
    return " ".join(f"{key}={counters.get(key)}" for key in keys)


# ---------------------------------------------------------------- part: disconnects


@dataclass(frozen=True, slots=True, kw_only=True)
class DisconnectRecord:
    plan: str  # "before first chunk", "after k", "read to end"
    planned_chunks: int | None
    chunks: int
    outcome: str  # disconnected, completed, or an error


async def disconnect_client(
    client: openai.AsyncOpenAI, gate: asyncio.Semaphore, prompt: str, planned: int | None, max_tokens: int
) -> DisconnectRecord:
    plan = "read to end" if planned is None else ("before first chunk" if planned == 0 else "after k chunks")
    chunks = 0
    async with gate:
        try:
            stream = await client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
            )
            if planned == 0:
                await stream.close()
                return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=0, outcome="disconnected")
            finish: str | None = None
            async for chunk in stream:
                chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if planned is not None and chunks >= planned:
                    await stream.close()
                    outcome = "disconnected" if finish is None else "completed before disconnect"
                    return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=chunks, outcome=outcome)
            outcome = "completed" if finish is not None else "stream ended without finish_reason"
            return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=chunks, outcome=outcome)
        except openai.APIStatusError as error:
            return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=chunks, outcome=status_outcome(error))
        except openai.APIError as error:
            outcome = f"error: {type(error).__name__}: {error}"
            return DisconnectRecord(plan=plan, planned_chunks=planned, chunks=chunks, outcome=outcome)


def disconnect_plan(rng: random.Random, max_chunks: int) -> int | None:
    draw = rng.random()
    if draw < 0.15:
        return 0
    if draw < 0.90:
        return rng.randint(1, max_chunks)
    return None


async def disconnect_traffic(server: RunningServer, args: argparse.Namespace) -> list[DisconnectRecord]:
    rng = random.Random(args.seed)
    plans = [disconnect_plan(rng, args.disconnect_max_chunks) for _ in range(args.disconnect_requests)]
    prompts = [f"Request {i}: {words(rng, 12)}" for i in range(args.disconnect_requests)]
    gate = asyncio.Semaphore(8)
    async with async_client(server) as client:
        jobs = [
            disconnect_client(client, gate, prompt, planned, args.disconnect_max_tokens)
            for prompt, planned in zip(prompts, plans, strict=True)
        ]
        return list(await asyncio.gather(*jobs))


def run_disconnects(setup: Setup) -> PartResult:
    args = setup.args
    result = PartResult(
        name="disconnects",
        command="bench.reliability --parts disconnects",
        server_commands=[command_text(setup, [])],
    )
    with courier(setup, [], "disconnects") as server:
        before = scheduler(server)
        rss_before = rss_kib(server.process.pid)
        records = asyncio.run(disconnect_traffic(server, args))
        first, after, idle_s = wait_idle(server)
        time.sleep(1.0)  # the counters of a request that ends as the clients finish settle within a step
        settled = scheduler(server)
        rss_after = rss_kib(server.process.pid)
        exit_code = stop_and_exit_code(server)
    plans = Counter(record.plan for record in records)
    outcomes = Counter(record.outcome for record in records)
    early = outcomes["disconnected"]
    finished = outcomes["completed"] + outcomes["completed before disconnect"]
    delta = {key: settled[key] - before[key] for key in ("completed", "cancelled", "failed", "rejected")}
    errors = {
        key: value
        for key, value in outcomes.items()
        if key not in ("disconnected", "completed", "completed before disconnect")
    }
    result.row("requests (max_tokens, concurrency)", f"{len(records)} ({args.disconnect_max_tokens}, 8)")
    result.row("plans", counts_text(plans))
    result.row("client outcomes", counts_text(outcomes))
    result.row("/health delta", " ".join(f"{key}=+{value}" for key, value in delta.items()))
    result.row("/health after (immediately)", counters_text(first))
    result.row("/health after (idle, +1 s)", f"{counters_text(settled)} (idle after {idle_s:.1f} s)")
    result.row("server RSS before / after (MiB)", f"{mib(rss_before)} / {mib(rss_after)}")
    result.row("exit code after SIGTERM", exit_code)
    result.check("every client ended (no errors)", not errors, counts_text(errors))
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
    result.data = {
        "settings": {
            "requests": args.disconnect_requests,
            "max_tokens": args.disconnect_max_tokens,
            "max_chunks": args.disconnect_max_chunks,
            "seed": args.seed,
        },
        "plans": dict(plans),
        "outcomes": dict(outcomes),
        "health_before": before,
        "health_after_immediately": first,
        "health_after_settled": settled,
        "delta": delta,
        "exit_code": exit_code,
        "records": [asdict(record) for record in records],
    }
    return result


# ---------------------------------------------------------------- part: soak


class StreamIncomplete(Exception):
    """A stream that ended without its terminal event."""


class Tally:
    """Outcomes by (kind, outcome), shared by the soak's client threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.examples: dict[tuple[str, str], str] = {}

    def add(self, kind: str, outcome: str, example: str = "") -> None:
        with self._lock:
            self.counts[(kind, outcome)] += 1
            if example and (kind, outcome) not in self.examples:
                self.examples[(kind, outcome)] = example[:500]


def attempt(tally: Tally, kind: str, call: Callable[[], T]) -> T | None:
    """Run one request; tally its outcome; the result, or None when it failed."""
    try:
        value = call()
    except openai.APIStatusError as error:
        tally.add(kind, status_outcome(error), str(error))
        return None
    except openai.APIConnectionError as error:
        tally.add(kind, f"connection error: {type(error).__name__}", str(error))
        return None
    except openai.APIError as error:
        tally.add(kind, f"stream error {getattr(error, 'code', None)}", str(error))
        return None
    except StreamIncomplete as error:
        tally.add(kind, "stream incomplete", str(error))
        return None
    tally.add(kind, "200")
    return value


def soak_chat(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random, name: str) -> None:
    conversation = 0
    while time.monotonic() < deadline:
        conversation += 1
        user = f"{name}-{conversation}"
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": f"You are {words(rng, 30)}."}]
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": words(rng, rng.randint(10, 40))})
            max_tokens = rng.randint(16, 48)
            call = stream_chat if turn % 2 else whole_chat
            text = attempt(
                tally, "chat stream" if turn % 2 else "chat", partial(call, client, messages, max_tokens, user)
            )
            if text is None:
                break
            messages.append({"role": "assistant", "content": text})


def whole_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=max_tokens, user=user)
    return reply.choices[0].message.content or ""


def stream_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    parts: list[str] = []
    finish: str | None = None
    for chunk in client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=max_tokens, user=user, stream=True
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    if finish is None:
        raise StreamIncomplete("stream ended without finish_reason")
    return "".join(parts)


def soak_chain(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    while time.monotonic() < deadline:
        previous: str | None = None
        for _ in range(6):
            if time.monotonic() >= deadline:
                return
            text = words(rng, rng.randint(10, 30))
            previous = attempt(tally, "responses chain", partial(chain_hop, client, text, previous))
            if previous is None:
                break


def chain_hop(client: openai.OpenAI, text: str, previous: str | None) -> str:
    response = client.responses.create(model=SERVED, input=text, max_output_tokens=24, previous_response_id=previous)
    return response.id


def soak_conversation(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    while time.monotonic() < deadline:
        conversation = attempt(tally, "conversation create", client.conversations.create)
        if conversation is None:
            time.sleep(0.5)
            continue
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            text = words(rng, rng.randint(10, 30))
            call = stream_response if turn % 2 else whole_response
            kind = "conversation turn stream" if turn % 2 else "conversation turn"
            if attempt(tally, kind, partial(call, client, text, conversation.id)) is None:
                break


def whole_response(client: openai.OpenAI, text: str, conversation: str) -> str:
    response = client.responses.create(model=SERVED, input=text, max_output_tokens=24, conversation=conversation)
    return str(response.status)


def stream_response(client: openai.OpenAI, text: str, conversation: str) -> str:
    terminal = ""
    for event in client.responses.create(
        model=SERVED, input=text, max_output_tokens=24, conversation=conversation, stream=True
    ):
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            terminal = event.type
    if terminal not in ("response.completed", "response.incomplete"):
        raise StreamIncomplete(f"stream ended with {terminal or 'no terminal event'}")
    return terminal


def soak_compact(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    while time.monotonic() < deadline:
        history: list[ResponseInputItemParam] = []
        for turn in range(4):
            history.append({"role": "user", "content": f"Turn {turn}: {words(rng, 60)}"})
            history.append({"role": "assistant", "content": words(rng, 60)})
        history.append({"role": "user", "content": words(rng, 10)})
        attempt(tally, "compact", partial(compact, client, history))


def compact(client: openai.OpenAI, history: list[ResponseInputItemParam]) -> str:
    compacted = client.responses.compact(model=SERVED, input=history, extra_body={"max_output_tokens": 32})
    return compacted.id


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    t_s: float
    rss_kib: int | None
    snapshot_bytes: int
    snapshot_capacity_bytes: int
    snapshot_entries: int
    snapshot_evictions_lru: int
    running: int
    waiting: int
    mlx_active_bytes: int
    mlx_cache_bytes: int
    malloc_in_use_bytes: int | None = None  # glibc's heap, from /health "malloc" (None off glibc)
    malloc_free_held_bytes: int | None = None


def sampler(server: RunningServer, every: float, stop: threading.Event, samples: list[Sample], t0: float) -> None:
    while True:
        try:
            stats = get_json(server, "/v1/cache/stats")
            health = get_json(server, "/health")
            counters, memory = health["scheduler"], health["memory"]
            samples.append(
                Sample(
                    t_s=time.monotonic() - t0,
                    rss_kib=rss_kib(server.process.pid),
                    snapshot_bytes=stats["snapshot_bytes"],
                    snapshot_capacity_bytes=stats["snapshot_capacity_bytes"],
                    snapshot_entries=stats["snapshot_entries"],
                    snapshot_evictions_lru=stats["snapshot_evictions_lru"],
                    running=counters["running"],
                    waiting=counters["waiting"],
                    mlx_active_bytes=memory["active_bytes"],
                    mlx_cache_bytes=memory["cache_bytes"],
                    malloc_in_use_bytes=(health.get("malloc") or {}).get("in_use_bytes"),
                    malloc_free_held_bytes=(health.get("malloc") or {}).get("free_held_bytes"),
                )
            )
        except (httpx.HTTPError, KeyError, ValueError) as error:
            progress(f"soak: sample failed: {error}")
        if stop.wait(every):
            return


def soak_traffic(server: RunningServer, args: argparse.Namespace) -> tuple[Tally, list[Sample], float]:
    tally = Tally()
    samples: list[Sample] = []
    t0 = time.monotonic()
    deadline = t0 + args.soak_seconds
    stop = threading.Event()
    watcher = threading.Thread(target=sampler, args=(server, args.sample_every, stop, samples, t0), daemon=True)
    watcher.start()
    client = sync_client(server)
    workers: list[Callable[[], None]] = [
        lambda: soak_chat(client, tally, deadline, random.Random(args.seed), "soak-chat-a"),
        lambda: soak_chat(client, tally, deadline, random.Random(args.seed + 1), "soak-chat-b"),
        lambda: soak_chain(client, tally, deadline, random.Random(args.seed + 2)),
        lambda: soak_conversation(client, tally, deadline, random.Random(args.seed + 3)),
        lambda: soak_compact(client, tally, deadline, random.Random(args.seed + 4)),
    ]
    threads = [threading.Thread(target=worker, daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.soak_seconds + args.hang_bound)
    clients_done = time.monotonic() - t0
    hung_threads = sum(thread.is_alive() for thread in threads)
    stop.set()
    watcher.join(HTTP_TIMEOUT_S)
    client.close()
    if hung_threads:
        tally.add("soak", "client thread still running", f"{hung_threads} threads")
    return tally, samples, clients_done


def is_expected(kind: str, outcome: str) -> bool:
    return outcome == "200" or (kind == "compact" and outcome == EXPECTED_COMPACT_OUTCOME)


def is_failure(kind: str, outcome: str) -> bool:
    return not is_expected(kind, outcome) and outcome[:1] != "4"


def run_soak(setup: Setup) -> PartResult:
    args = setup.args
    flags = ["--prompt-cache-snapshot-capacity-bytes", args.soak_snapshot_capacity]
    if args.soak_mlx_cache_limit is not None:
        flags += ["--mlx-cache-limit", args.soak_mlx_cache_limit]
    result = PartResult(
        name="soak",
        command=f"bench.reliability --parts soak --soak-seconds {args.soak_seconds:g}",
        server_commands=[command_text(setup, flags)],
    )
    with courier(setup, flags, "soak") as server:
        progress(f"soak: {args.soak_seconds:g} s of mixed traffic")
        tally, samples, clients_s = soak_traffic(server, args)
        first, after, idle_s = wait_idle(server)
        stats = get_json(server, "/v1/cache/stats")
        rss_end = rss_kib(server.process.pid)
        exit_code = stop_and_exit_code(server)
    failures = {f"{k} / {o}": n for (k, o), n in tally.counts.items() if is_failure(k, o)}
    client_4xx = {f"{k} / {o}": n for (k, o), n in tally.counts.items() if o[:1] == "4" and not is_expected(k, o)}
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.counts.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    capacity = max((s.snapshot_capacity_bytes for s in samples), default=0)
    max_bytes = max((s.snapshot_bytes for s in samples), default=0)
    over = [s for s in samples if s.snapshot_bytes > s.snapshot_capacity_bytes]
    minute = min(samples, key=lambda s: abs(s.t_s - 60.0)) if samples else None
    last = samples[-1] if samples else None
    rss_values = [s.rss_kib for s in samples if s.rss_kib is not None]
    growth = (rss_end - minute.rss_kib) if rss_end is not None and minute and minute.rss_kib is not None else None
    result.row("duration (s) / samples", f"{args.soak_seconds:g} (clients done at {clients_s:.1f}) / {len(samples)}")
    for kind, outcomes in by_kind.items():
        result.row(f"outcomes: {kind}", counts_text(outcomes))
    result.row("requests in all", sum(tally.counts.values()))
    result.row("snapshot bytes max / budget", f"{max_bytes} / {capacity} ({len(over)} samples over)")
    result.row(
        "snapshot entries / LRU evictions at end", f"{stats['snapshot_entries']} / {stats['snapshot_evictions_lru']}"
    )
    result.row(
        "snapshot stats at end",
        ", ".join(
            f"{key}={stats[key]}"
            for key in (
                "snapshot_inserts",
                "snapshot_hits",
                "snapshot_lookups",
                "snapshot_rejections_oversized",
                "snapshot_self_evictions",
            )
        ),
    )
    result.row(
        "max running / waiting sampled",
        f"{max((s.running for s in samples), default=0)} / {max((s.waiting for s in samples), default=0)}",
    )
    result.row(
        "RSS first sample / ~60 s / max / end (MiB)",
        f"{mib(rss_values[0] if rss_values else None)} / {mib(minute.rss_kib if minute else None)} / "
        f"{mib(max(rss_values, default=None))} / {mib(rss_end)}",
    )
    result.row("RSS growth ~60 s -> end (MiB)", mib(growth))
    if samples and minute is not None and last is not None:
        result.row(
            "MLX cache of freed buffers first / ~60 s / max / last (MiB)",
            " / ".join(
                f"{value / 2**20:.1f}"
                for value in (
                    samples[0].mlx_cache_bytes,
                    minute.mlx_cache_bytes,
                    max(s.mlx_cache_bytes for s in samples),
                    last.mlx_cache_bytes,
                )
            ),
        )
        result.row(
            "MLX arrays first / ~60 s / last (MiB)",
            f"{samples[0].mlx_active_bytes / 2**20:.1f} / {minute.mlx_active_bytes / 2**20:.1f} / "
            f"{last.mlx_active_bytes / 2**20:.1f}",
        )
        for label, field_name in (("in use", "malloc_in_use_bytes"), ("freed but held", "malloc_free_held_bytes")):
            values = [getattr(s, field_name) for s in (samples[0], minute, last)]
            if None not in values:
                result.row(f"malloc {label} first / ~60 s / last (MiB)", " / ".join(f"{v / 2**20:.1f}" for v in values))
    result.row(
        "/health after clients stopped", f"{counters_text(first)}; idle: {counters_text(after)} ({idle_s:.1f} s)"
    )
    result.row("exit code after SIGTERM", exit_code)
    result.check("no failures (5xx, stream/connection errors)", not failures, counts_text(failures))
    result.check("no 4xx answers (but 422 compaction_failed)", not client_4xx, counts_text(client_4xx))
    result.check(
        "snapshot bytes never over the budget (sampled)",
        not over and max_bytes <= capacity,
        f"max {max_bytes} of {capacity}",
    )
    result.check(
        "the budget made the store evict",
        stats["snapshot_evictions_lru"] > 0,
        f"{stats['snapshot_evictions_lru']} LRU evictions",
    )
    result.check("running == waiting == 0 once clients stop", idle(first), counters_text(first))
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    result.data = {
        "settings": {
            "seconds": args.soak_seconds,
            "sample_every": args.sample_every,
            "snapshot_capacity": args.soak_snapshot_capacity,
            "seed": args.seed,
        },
        "outcomes": by_kind,
        "examples": {f"{k} / {o}": text for (k, o), text in tally.examples.items()},
        "cache_stats_end": stats,
        "health_after_immediately": first,
        "health_after_idle": after,
        "rss_kib": {"minute": minute.rss_kib if minute else None, "end": rss_end, "last_sample": last and last.rss_kib},
        "exit_code": exit_code,
        "samples": [asdict(sample) for sample in samples],
    }
    return result


# ---------------------------------------------------------------- part: kill


@dataclass(frozen=True, slots=True, kw_only=True)
class Acknowledged:
    id: str
    status: str
    output_text: str
    output: list[dict[str, Any]]
    previous_response_id: str | None


class KillTraffic:
    """Client threads creating stored responses until the server dies; what was acknowledged, and the errors."""

    def __init__(self, client: openai.OpenAI) -> None:
        self.client = client
        self.acks: list[Acknowledged] = []
        self.errors: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def writer(self, index: int) -> None:
        rng = random.Random(index)
        previous: str | None = None
        chained = index % 2 == 1
        while not self.stop.is_set():
            try:
                response = self.client.responses.create(
                    model=SERVED,
                    input=f"Writer {index}: {words(rng, 12)}",
                    max_output_tokens=8,
                    previous_response_id=previous if chained else None,
                )
            except openai.APIError as error:
                with self.lock:
                    self.errors[type(error).__name__] += 1
                previous = None
                if isinstance(error, openai.APIConnectionError):
                    return  # the server is gone
                continue
            ack = Acknowledged(
                id=response.id,
                status=str(response.status),
                output_text=response.output_text,
                output=[item.model_dump(mode="json") for item in response.output],
                previous_response_id=response.previous_response_id,
            )
            with self.lock:
                self.acks.append(ack)
                previous = response.id if len(self.acks) % 4 else None  # chains of a few hops


def integrity(path: Path) -> str:
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute("PRAGMA integrity_check").fetchall()
    finally:
        connection.close()
    return "; ".join(str(row[0]) for row in rows)


def kill_mid_traffic(setup: Setup, flags: Sequence[str]) -> tuple[KillTraffic, int]:
    """Writers against a server that gets SIGKILL after `--kill-after` seconds; the traffic and the exit status."""
    args = setup.args
    with courier(setup, flags, "kill-first") as server:
        traffic = KillTraffic(sync_client(server))
        writers = [threading.Thread(target=traffic.writer, args=(i,), daemon=True) for i in range(args.kill_writers)]
        for writer in writers:
            writer.start()
        time.sleep(args.kill_after)
        server.process.send_signal(signal.SIGKILL)
        killed_code = server.process.wait(HTTP_TIMEOUT_S)
        progress(f"kill: SIGKILL after {args.kill_after:g} s with {len(traffic.acks)} acknowledged")
        for writer in writers:
            writer.join(HTTP_TIMEOUT_S)
        traffic.stop.set()
        traffic.client.close()
    return traffic, killed_code


def verify_after_restart(
    setup: Setup, flags: Sequence[str], acks: Sequence[Acknowledged]
) -> tuple[list[str], list[str], int]:
    """Restart on the same data dir; the acknowledged ids missing, those that differ, and the exit code."""
    missing: list[str] = []
    different: list[str] = []
    with courier(setup, flags, "kill-restart") as server:
        client = sync_client(server)
        for ack in acks:
            try:
                stored = client.responses.retrieve(ack.id)
            except openai.APIStatusError as error:
                missing.append(f"{ack.id}: {status_outcome(error)}")
                continue
            same = (
                str(stored.status) == ack.status
                and stored.output_text == ack.output_text
                and [item.model_dump(mode="json") for item in stored.output] == ack.output
                and stored.previous_response_id == ack.previous_response_id
            )
            if not same:
                different.append(ack.id)
        client.close()
        exit_code = stop_and_exit_code(server)
    return missing, different, exit_code


def run_kill(setup: Setup) -> PartResult:
    args = setup.args
    data_dir = setup.cache_dir / "reliability-kill-data"
    shutil.rmtree(data_dir, ignore_errors=True)
    flags = ["--data-dir", str(data_dir)]
    result = PartResult(
        name="kill", command="bench.reliability --parts kill", server_commands=[command_text(setup, flags)]
    )
    traffic, killed_code = kill_mid_traffic(setup, flags)
    acks = traffic.acks
    crash_copy = setup.cache_dir / "reliability-kill-data-at-crash"
    shutil.rmtree(crash_copy, ignore_errors=True)
    shutil.copytree(data_dir, crash_copy)
    crash_files = sorted(path.name for path in crash_copy.iterdir())
    integrity_at_crash = integrity(crash_copy / "courier.sqlite3")
    missing, different, restart_exit = verify_after_restart(setup, flags, acks)
    integrity_after = integrity(data_dir / "courier.sqlite3")
    retrievable = len(acks) - len(missing)
    chained = sum(1 for ack in acks if ack.previous_response_id)
    result.row("writers / SIGKILL after (s)", f"{args.kill_writers} / {args.kill_after:g}")
    result.row("acknowledged (200 with a body)", f"{len(acks)} ({chained} with previous_response_id)")
    result.row("client errors at the kill", counts_text(traffic.errors))
    result.row("kill exit status", killed_code)
    result.row("files after the kill", ", ".join(crash_files))
    result.row("integrity_check right after the kill (copy)", integrity_at_crash)
    result.row("retrievable after restart / equal output", f"{retrievable} / {retrievable - len(different)}")
    result.row("integrity_check after restart and stop", integrity_after)
    result.row("restarted server's exit code after SIGTERM", restart_exit)
    result.check("some responses were acknowledged", len(acks) > 0, len(acks))
    result.check("every acknowledged response is retrievable", not missing, "; ".join(missing[:5]))
    result.check("every retrieved response equals what was acknowledged", not different, ", ".join(different[:5]))
    result.check("integrity_check ok after the kill", integrity_at_crash == "ok", integrity_at_crash)
    result.check("integrity_check ok after restart", integrity_after == "ok", integrity_after)
    result.check("clean exit (0) of the restarted server", restart_exit == 0, restart_exit)
    result.data = {
        "settings": {"writers": args.kill_writers, "kill_after_s": args.kill_after},
        "acknowledged": len(acks),
        "retrievable": retrievable,
        "different": different,
        "missing": missing,
        "client_errors": dict(traffic.errors),
        "kill_exit_status": killed_code,
        "files_after_kill": crash_files,
        "integrity_after_kill": integrity_at_crash,
        "integrity_after_restart": integrity_after,
        "restart_exit_code": restart_exit,
        "ids": [ack.id for ack in acks],
    }
    return result


# ---------------------------------------------------------------- part: shutdown


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
    finish: str | None = None
    try:
        stream = await client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": f"Write {record.max_tokens} words."}],
            max_tokens=record.max_tokens,
            stream=True,
        )
        async for chunk in stream:
            record.chunks += 1
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        record.outcome = f"completed ({finish})" if finish else "stream ended without finish_reason"
    except openai.APIStatusError as error:
        record.outcome = f"status {status_outcome(error)}"
    except openai.APIConnectionError as error:
        record.outcome = f"connection error: {type(error).__name__}"
    except openai.APIError as error:
        record.outcome = "error event"
        record.error_code = str(getattr(error, "code", None))
        record.error_message = error.message
    finally:
        started.set()
        if sigterm_at:
            record.ended_after_sigterm_s = time.monotonic() - sigterm_at[0]


async def drain_probe(http: httpx.AsyncClient) -> str:
    """A new chat completion during the drain, on `http`'s connection (new, or kept alive from before)."""
    try:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    except httpx.HTTPError as error:
        return f"{type(error).__name__}: {error}"
    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
    return f"{response.status_code} {code or ''} Retry-After={response.headers.get('retry-after')}"


async def shutdown_traffic(
    server: RunningServer, args: argparse.Namespace
) -> tuple[list[ShutdownRecord], dict[str, str], float]:
    records = [ShutdownRecord(max_tokens=16 if i < 4 else 1800) for i in range(8)]
    started = [asyncio.Event() for _ in records]
    sigterm_at: list[float] = []
    async with async_client(server) as client, httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as kept_alive:
        await kept_alive.get("/health")  # opens the connection the second probe reuses
        tasks = [
            asyncio.create_task(shutdown_client(client, record, event, sigterm_at))
            for record, event in zip(records, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), args.hang_bound)
        sigterm_at.append(time.monotonic())
        server.process.send_signal(signal.SIGTERM)
        progress("shutdown: SIGTERM with 8 streams in flight")
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10.0) as fresh:
            probe = {"new connection": await drain_probe(fresh), "kept-alive connection": await drain_probe(kept_alive)}
        _, pending = await asyncio.wait(tasks, timeout=args.hang_bound)
        for task in pending:
            task.cancel()
    exit_code = await asyncio.to_thread(server.process.wait, args.hang_bound)
    exit_s = time.monotonic() - sigterm_at[0]
    return records, probe, exit_s if exit_code is not None else float("nan")


def run_shutdown(setup: Setup) -> PartResult:
    args = setup.args
    flags = ["--shutdown-timeout", f"{args.shutdown_timeout:g}"]
    result = PartResult(
        name="shutdown",
        command=f"bench.reliability --parts shutdown --shutdown-timeout {args.shutdown_timeout:g}",
        server_commands=[command_text(setup, flags)],
    )
    with courier(setup, flags, "shutdown") as server:
        records, probe, exit_s = asyncio.run(shutdown_traffic(server, args))
        exit_code = server.wait_exit()
    outcomes = Counter(record.outcome for record in records)
    terminal = all(r.outcome.startswith("completed") or r.outcome == "error event" for r in records)
    bound = args.shutdown_timeout + args.exit_slack
    result.row("streams (max_tokens)", ", ".join(str(r.max_tokens) for r in records))
    result.row("client outcomes", counts_text(outcomes))
    result.row("error event codes", counts_text(Counter(r.error_code for r in records if r.error_code)))
    result.row(
        "streams ended after SIGTERM (s)",
        ", ".join("n/a" if r.ended_after_sigterm_s is None else f"{r.ended_after_sigterm_s:.2f}" for r in records),
    )
    for connection, outcome in probe.items():
        result.row(f"a new request 0.5 s into the drain ({connection})", outcome)
    result.row("exit code / time to exit (s)", f"{exit_code} / {exit_s:.2f} (bound {bound:g})")
    result.check("every client got a terminal outcome", terminal, counts_text(outcomes))
    result.check("exit code 0", exit_code == 0, exit_code)
    result.check("exited within --shutdown-timeout + slack", exit_s <= bound, f"{exit_s:.2f} s")
    result.data = {
        "settings": {"shutdown_timeout": args.shutdown_timeout, "exit_slack": args.exit_slack},
        "records": [asdict(record) for record in records],
        "drain_probe": probe,
        "exit_code": exit_code,
        "exit_s": exit_s,
    }
    return result


# ---------------------------------------------------------------- report


RUNNERS: dict[str, Callable[[Setup], PartResult]] = {
    "load": run_load,
    "disconnects": run_disconnects,
    "soak": run_soak,
    "kill": run_kill,
    "shutdown": run_shutdown,
}


def source_state() -> dict[str, object]:
    """The checkout measured (read-only git commands; the working tree may differ from HEAD)."""

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=False
            )
        except OSError:
            return ""
        return done.stdout.strip()

    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line[3:].startswith("courier/")]
    return {"head": git("rev-parse", "--short", "HEAD"), "courier_files_changed_from_head": changed}


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier reliability\n")
    print(
        f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, courier {env['courier']}, "
        f"openai {env['openai']}"
    )
    print(f"- machine: {env['platform']} ({env['machine']}), {env['cpu_count']} CPUs")
    changed = report.source["courier_files_changed_from_head"]
    print(f"- source: HEAD {report.source['head']}" + (f", working tree differs in {changed}" if changed else ""))
    print(f"- model: tiny random-weight llama (tests/support/tiny_models.py), served as `{SERVED}`")
    print(f"- settings: {report.settings}\n")
    for part in report.parts:
        verdict = "PASS" if part.passed else "FAIL"
        print(f"### {part.name}: {verdict}\n")
        print(f"Command: `.venv/bin/python -m {part.command}`\n")
        for command in part.server_commands:
            print(f"Server: `{command}`\n")
        if part.error is not None:
            print(f"**Error:** {part.error}\n")
        if part.rows:
            print("| figure | value |")
            print("|---|---|")
            for metric, value in part.rows:
                print(f"| {metric} | {value.replace('|', '/')} |")
            print()
        if part.checks:
            print("| check | result | detail |")
            print("|---|---|---|")
            for check in part.checks:
                print(f"| {check.name} | {'pass' if check.passed else 'FAIL'} | {check.detail.replace('|', '/')} |")
            print()


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--parts", type=choices(PARTS), default=list(PARTS), help=f"parts to run ({','.join(PARTS)})")
    add("--seed", type=int, default=0, help="random seed (0)")
    add("--hang-bound", type=float, default=120.0, help="seconds a client may take before it counts as hung (120)")
    add("--load-waves", type=int, default=3, help="load: waves of concurrent clients (3)")
    add("--load-clients", type=int, default=64, help="load: concurrent streaming clients per wave (64)")
    add("--load-max-tokens", type=int, default=64, help="load: max_tokens per request (64)")
    add("--load-probes", type=int, default=20, help="load: requests sent one by one while the queue is full (20)")
    add("--disconnect-requests", type=int, default=200, help="disconnects: requests (200)")
    add("--disconnect-max-tokens", type=int, default=256, help="disconnects: max_tokens per request (256)")
    add("--disconnect-max-chunks", type=int, default=32, help="disconnects: most chunks read before closing (32)")
    add("--soak-seconds", type=float, default=180.0, help="soak: seconds of traffic (180)")
    add("--sample-every", type=float, default=2.0, help="soak: seconds between samples (2)")
    add("--soak-snapshot-capacity", default="4MiB", help="soak: --prompt-cache-snapshot-capacity-bytes (4MiB)")
    add("--soak-mlx-cache-limit", default=None, help="soak: the server's --mlx-cache-limit (its default when unset)")
    add("--kill-writers", type=int, default=4, help="kill: client threads (4)")
    add("--kill-after", type=float, default=10.0, help="kill: seconds of traffic before SIGKILL (10)")
    add("--shutdown-timeout", type=float, default=5.0, help="shutdown: the server's --shutdown-timeout (5)")
    add("--exit-slack", type=float, default=5.0, help="shutdown: seconds allowed past the timeout to exit (5)")
    add("--cache-dir", type=Path, default=None, help="model cache and data dirs (default: a temporary directory)")
    add("--log-dir", type=Path, default=None, help="server logs (default: CACHE/bench-logs)")
    add("--json", type=Path, default=None, help="also write the raw results here")
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> dict[str, object]:
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blas = load_optimized_blas()  # before MLX is imported, as the server does
    parts: list[PartResult] = []
    with cache_directory(args.cache_dir) as cache_dir:
        log_dir = (args.log_dir or cache_dir / "bench-logs").resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        progress("converting the embedded GGUF (the tiny model borrows its tokenizer)")
        model_dir = build_tiny_model("llama", prepare_4bit_dir(cache_dir), cache_dir)
        setup = Setup(model_dir=model_dir, cache_dir=cache_dir, log_dir=log_dir, args=args)
        for name in args.parts:
            progress(f"part {name}")
            try:
                parts.append(RUNNERS[name](setup))
            except Exception as error:  # one part's crash is reported, the others still run
                progress(f"{name}: FAILED: {type(error).__name__}: {error}")
                parts.append(
                    PartResult(
                        name=name,
                        command=f"bench.reliability --parts {name}",
                        server_commands=[],
                        error=f"{type(error).__name__}: {error}",
                    )
                )
    report = Report(environment=environment(blas), source=source_state(), settings=settings_of(args), parts=parts)
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    return 0 if all(part.passed for part in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
