"""Reliability of Courier under load and faults, on a tiny random-weight llama: overload, disconnects, a soak,
`kill -9` with stored responses, and SIGTERM mid-stream. Each part checks invariants; the exit code is 1 when one
fails."""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import ResponseInputItemParam

from bench.harness import cli
from bench.harness.clients import async_client, sync_client
from bench.harness.models import cache_directory, prepare_4bit_dir, tiny_model
from bench.harness.report import counts, environment, ms, progress, table, write_json
from bench.harness.servers import COURIER, Launcher, Server, ServerSpec
from bench.harness.stats import percentile_or_none
from courier.platform.blas import load_optimized_blas

PARTS = ("load", "disconnects", "soak", "kill", "shutdown")
SERVED = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[1]
HTTP_TIMEOUT_S = 30.0
IDLE_WAIT_S = 15.0
CLIENT_TIMEOUT_S = 300.0
LOAD_MAX_BATCH = 4
LOAD_MAX_QUEUE = 16
EXPECTED_COMPACT_OUTCOME = "422 compaction_failed"  # a soak compaction: random weights never end a summary
SNAPSHOT_STATS = (
    "snapshot_inserts", "snapshot_hits", "snapshot_lookups", "snapshot_rejections_oversized", "snapshot_self_evictions",
)  # fmt: skip
COUNTERS = ("running", "waiting", "completed", "cancelled", "failed", "rejected")
WORDS = (
    "apple", "river", "stone", "cloud", "lamp", "forest", "window", "bridge", "candle", "harbor", "meadow",
    "engine", "garden", "silver", "thunder", "paper", "violin", "desert", "comet", "lantern", "orbit", "pepper",
    "marble", "canyon", "falcon", "willow", "copper", "ember", "glacier", "kettle", "saddle", "tunnel", "walnut",
    "beacon", "quartz", "ribbon", "lagoon", "spindle", "cobalt",
)  # fmt: skip
T = TypeVar("T")


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
    server_commands: list[str] = field(default_factory=list)
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
class Setup:
    launcher: Launcher
    model_dir: Path
    args: argparse.Namespace

    def part(self, name: str, command: str, flags: Sequence[str] = ()) -> tuple[PartResult, Server]:
        """The part's result and its server (enter it to start it; its log goes to the log directory)."""
        spec = ServerSpec(name=COURIER, model_dir=self.model_dir, served_name=SERVED, flags=tuple(flags))
        server = self.launcher.server(spec, log_name=name)
        return PartResult(name=name, command=command, server_commands=[server.record.command_text()]), server


def rss_kib(pid: int) -> int | None:
    """VmRSS of a live process in KiB (None once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in lines if line.startswith("VmRSS:")), None)


def get_json(server: Server, path: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(server.base_url + path, timeout=HTTP_TIMEOUT_S).json()
    return body


def scheduler(server: Server) -> dict[str, Any]:
    counters: dict[str, Any] = get_json(server, "/health")["scheduler"]
    return counters


def wait_idle(server: Server) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The scheduler counters at once, then once running == waiting == 0 (or after IDLE_WAIT_S), and the wait."""
    started = time.monotonic()
    first = last = scheduler(server)
    while (last["running"] or last["waiting"]) and time.monotonic() - started < IDLE_WAIT_S:
        time.sleep(0.2)
        last = scheduler(server)
    return first, last, time.monotonic() - started


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def status_outcome(error: openai.APIStatusError) -> str:
    return f"{error.status_code} {error.code or ''}".strip()


def mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def idle(counters: dict[str, Any]) -> bool:
    return bool(counters["running"] == 0 and counters["waiting"] == 0)


def counters_text(counters: dict[str, Any]) -> str:
    return " ".join(f"{key}={counters.get(key)}" for key in COUNTERS)


def p50_p99_max(seconds: Sequence[float]) -> str:
    return " / ".join(
        ms(value) for value in (*(percentile_or_none(seconds, q) for q in (0.5, 0.99)), max(seconds, default=None))
    )


# ---------------------------------------------------------------- part: load


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRecord:
    wave: int
    outcome: str  # completed, stream ended without finish_reason, 429 queue_full, ..., hung, error: ...
    seconds: float
    chunks: int = 0
    retry_after: str | None = None
    probe: bool = False  # sent alone while the queue was full (not part of the burst)


@dataclass(slots=True)
class Read:
    """What one streamed chat completion delivered before it ended, failed or was closed."""

    chunks: int = 0
    finish: str | None = None

    @property
    def outcome(self) -> str:
        return "completed" if self.finish is not None else "stream ended without finish_reason"


async def read_chat(
    client: openai.AsyncOpenAI,
    prompt: str,
    max_tokens: int,
    read: Read,
    *,
    close_after: int | None = None,
    on_chunk: Callable[[], None] = lambda: None,
) -> bool:
    """Stream a chat completion into `read`; True when closed here after `close_after` chunks (0: before the first)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    stream = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=max_tokens, stream=True)
    if close_after == 0:
        await stream.close()
        return True
    async for chunk in stream:
        read.chunks += 1
        on_chunk()
        read.finish = (
            chunk.choices[0].finish_reason if chunk.choices and chunk.choices[0].finish_reason else read.finish
        )
        if close_after is not None and read.chunks >= close_after:
            await stream.close()
            return True
    return False


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


# ---------------------------------------------------------------- part: disconnects


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

    def attempt(self, kind: str, call: Callable[[], T]) -> T | None:
        """Run one request and tally its outcome: the result, or None when it failed."""
        try:
            value = call()
        except openai.APIStatusError as error:
            self.add(kind, status_outcome(error), str(error))
        except openai.APIConnectionError as error:
            self.add(kind, f"connection error: {type(error).__name__}", str(error))
        except openai.APIError as error:
            self.add(kind, f"stream error {getattr(error, 'code', None)}", str(error))
        except StreamIncomplete as error:
            self.add(kind, "stream incomplete", str(error))
        else:
            self.add(kind, "200")
            return value
        return None


def soak_chat(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random, name: str) -> None:
    """Conversations of six turns, one `user` each, every other turn streamed."""
    conversation = 0
    while time.monotonic() < deadline:
        conversation += 1
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": f"You are {words(rng, 30)}."}]
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": words(rng, rng.randint(10, 40))})
            call = partial(
                stream_chat if turn % 2 else whole_chat, client, messages, rng.randint(16, 48), f"{name}-{conversation}"
            )
            if (text := tally.attempt("chat stream" if turn % 2 else "chat", call)) is None:
                break
            messages.append({"role": "assistant", "content": text})


def whole_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=max_tokens, user=user)
    return reply.choices[0].message.content or ""


def stream_chat(client: openai.OpenAI, messages: list[ChatCompletionMessageParam], max_tokens: int, user: str) -> str:
    parts, finish = [], None
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
    """Responses chained by previous_response_id, six hops a chain."""
    while time.monotonic() < deadline:
        previous: str | None = None
        for _ in range(6):
            if time.monotonic() >= deadline:
                return
            create = partial(
                client.responses.create, model=SERVED, input=words(rng, rng.randint(10, 30)), max_output_tokens=24
            )
            if (response := tally.attempt("responses chain", partial(create, previous_response_id=previous))) is None:
                break
            previous = response.id


def soak_conversation(client: openai.OpenAI, tally: Tally, deadline: float, rng: random.Random) -> None:
    """Responses in a conversation (POST /v1/conversations first), every other turn streamed."""
    while time.monotonic() < deadline:
        if (conversation := tally.attempt("conversation create", client.conversations.create)) is None:
            time.sleep(0.5)
            continue
        for turn in range(6):
            if time.monotonic() >= deadline:
                return
            call = partial(
                stream_response if turn % 2 else whole_response,
                client,
                words(rng, rng.randint(10, 30)),
                conversation.id,
            )
            if tally.attempt("conversation turn stream" if turn % 2 else "conversation turn", call) is None:
                break


def whole_response(client: openai.OpenAI, text: str, conversation: str) -> str:
    return str(
        client.responses.create(model=SERVED, input=text, max_output_tokens=24, conversation=conversation).status
    )


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
    """Explicit compaction of a four-exchange history (random weights never end a summary: 422 is expected)."""
    while time.monotonic() < deadline:
        history: list[ResponseInputItemParam] = []
        for turn in range(4):
            history += [
                {"role": "user", "content": f"Turn {turn}: {words(rng, 60)}"},
                {"role": "assistant", "content": words(rng, 60)},
            ]
        history.append({"role": "user", "content": words(rng, 10)})
        tally.attempt(
            "compact",
            partial(client.responses.compact, model=SERVED, input=history, extra_body={"max_output_tokens": 32}),
        )


def sample(server: Server, t0: float) -> dict[str, Any]:
    """RSS, the snapshot store against its budget, the scheduler, MLX memory and glibc malloc's heap."""
    stats, health = get_json(server, "/v1/cache/stats"), get_json(server, "/health")
    counters, memory, malloc = health["scheduler"], health["memory"], health.get("malloc") or {}
    return {
        **{"t_s": time.monotonic() - t0, "rss_kib": rss_kib(server.pid)},
        **{
            key: stats[key]
            for key in ("snapshot_bytes", "snapshot_capacity_bytes", "snapshot_entries", "snapshot_evictions_lru")
        },
        **{"running": counters["running"], "waiting": counters["waiting"]},
        **{"mlx_active_bytes": memory["active_bytes"], "mlx_cache_bytes": memory["cache_bytes"]},
        **{"malloc_in_use_bytes": malloc.get("in_use_bytes"), "malloc_free_held_bytes": malloc.get("free_held_bytes")},
    }


def soak_traffic(server: Server, args: argparse.Namespace) -> tuple[Tally, list[dict[str, Any]], float]:
    """Five client threads until the deadline, a sampler every --sample-every seconds."""
    tally, samples, stop = Tally(), [], threading.Event()
    t0 = time.monotonic()
    deadline = t0 + args.soak_seconds

    def sampler() -> None:
        while True:
            try:
                samples.append(sample(server, t0))
            except (httpx.HTTPError, KeyError, ValueError) as error:
                progress(f"soak: sample failed: {error}")
            if stop.wait(args.sample_every):
                return

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    client = sync_client(server.base_url, CLIENT_TIMEOUT_S)
    workers: list[Callable[[], None]] = [
        partial(soak_chat, client, tally, deadline, random.Random(args.seed), "soak-chat-a"),
        partial(soak_chat, client, tally, deadline, random.Random(args.seed + 1), "soak-chat-b"),
        partial(soak_chain, client, tally, deadline, random.Random(args.seed + 2)),
        partial(soak_conversation, client, tally, deadline, random.Random(args.seed + 3)),
        partial(soak_compact, client, tally, deadline, random.Random(args.seed + 4)),
    ]
    threads = [threading.Thread(target=worker, daemon=True) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.soak_seconds + args.hang_bound)
    clients_done = time.monotonic() - t0
    stop.set()
    watcher.join(HTTP_TIMEOUT_S)
    client.close()
    if hung := sum(thread.is_alive() for thread in threads):
        tally.add("soak", "client thread still running", f"{hung} threads")
    return tally, samples, clients_done


def is_expected(kind: str, outcome: str) -> bool:
    return outcome == "200" or (kind == "compact" and outcome == EXPECTED_COMPACT_OUTCOME)


def run_soak(setup: Setup) -> PartResult:
    args = setup.args
    flags = ["--prompt-cache-snapshot-capacity-bytes", args.soak_snapshot_capacity]
    flags += ["--mlx-cache-limit", args.soak_mlx_cache_limit] if args.soak_mlx_cache_limit is not None else []
    result, courier = setup.part("soak", f"bench.reliability --parts soak --soak-seconds {args.soak_seconds:g}", flags)
    with courier as server:
        progress(f"soak: {args.soak_seconds:g} s of mixed traffic")
        tally, samples, clients_s = soak_traffic(server, args)
        first, after, idle_s = wait_idle(server)
        stats, rss_end = get_json(server, "/v1/cache/stats"), rss_kib(server.pid)
        exit_code = server.stop(signal.SIGTERM)
    tallied = {f"{k} / {o}": (k, o, n) for (k, o), n in tally.counts.items()}
    failures = {name: n for name, (k, o, n) in tallied.items() if not is_expected(k, o) and o[:1] != "4"}
    client_4xx = {name: n for name, (k, o, n) in tallied.items() if o[:1] == "4" and not is_expected(k, o)}
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in sorted(tally.counts.items()):
        by_kind.setdefault(kind, {})[outcome] = count
    capacity = max((s["snapshot_capacity_bytes"] for s in samples), default=0)
    max_bytes = max((s["snapshot_bytes"] for s in samples), default=0)
    over = [s for s in samples if s["snapshot_bytes"] > s["snapshot_capacity_bytes"]]
    minute = min(samples, key=lambda s: abs(s["t_s"] - 60.0)) if samples else None
    rss_values = [s["rss_kib"] for s in samples if s["rss_kib"] is not None]
    growth = rss_end - minute["rss_kib"] if rss_end is not None and minute and minute["rss_kib"] is not None else None
    result.row("duration (s) / samples", f"{args.soak_seconds:g} (clients done at {clients_s:.1f}) / {len(samples)}")
    for kind, outcomes in by_kind.items():
        result.row(f"outcomes: {kind}", counts(outcomes))
    result.row("requests in all", sum(tally.counts.values()))
    result.row("snapshot bytes max / budget", f"{max_bytes} / {capacity} ({len(over)} samples over)")
    result.row(
        "snapshot entries / LRU evictions at end", f"{stats['snapshot_entries']} / {stats['snapshot_evictions_lru']}"
    )
    result.row("snapshot stats at end", ", ".join(f"{key}={stats[key]}" for key in SNAPSHOT_STATS))
    result.row(
        "max running / waiting sampled",
        " / ".join(str(max((s[key] for s in samples), default=0)) for key in ("running", "waiting")),
    )
    first_rss, minute_rss = rss_values[0] if rss_values else None, minute["rss_kib"] if minute else None
    rss = (first_rss, minute_rss, max(rss_values, default=None), rss_end)
    result.row("RSS first sample / ~60 s / max / end (MiB)", " / ".join(mib(value) for value in rss))
    result.row("RSS growth ~60 s -> end (MiB)", mib(growth))
    if samples and minute is not None:

        def mebibytes(key: str, chosen: Sequence[dict[str, Any]]) -> str:
            return " / ".join(f"{s[key] / 2**20:.1f}" for s in chosen)

        top = max(samples, key=lambda s: s["mlx_cache_bytes"])
        result.row(
            "MLX cache of freed buffers first / ~60 s / max / last (MiB)",
            mebibytes("mlx_cache_bytes", (samples[0], minute, top, samples[-1])),
        )
        result.row(
            "MLX arrays first / ~60 s / last (MiB)", mebibytes("mlx_active_bytes", (samples[0], minute, samples[-1]))
        )
        for label, key in (("in use", "malloc_in_use_bytes"), ("freed but held", "malloc_free_held_bytes")):
            if all(s[key] is not None for s in (samples[0], minute, samples[-1])):
                result.row(
                    f"malloc {label} first / ~60 s / last (MiB)", mebibytes(key, (samples[0], minute, samples[-1]))
                )
    result.row(
        "/health after clients stopped", f"{counters_text(first)}; idle: {counters_text(after)} ({idle_s:.1f} s)"
    )
    result.row("exit code after SIGTERM", exit_code)
    result.check("no failures (5xx, stream/connection errors)", not failures, counts(failures))
    result.check("no 4xx answers (but 422 compaction_failed)", not client_4xx, counts(client_4xx))
    result.check(
        "snapshot bytes never over the budget (sampled)",
        not over and max_bytes <= capacity,
        f"max {max_bytes} of {capacity}",
    )
    evictions = stats["snapshot_evictions_lru"]
    result.check("the budget made the store evict", evictions > 0, f"{evictions} LRU evictions")
    result.check("running == waiting == 0 once clients stop", idle(first), counters_text(first))
    result.check("clean exit (0) on SIGTERM", exit_code == 0, exit_code)
    examples = {f"{k} / {o}": text for (k, o), text in tally.examples.items()}
    result.data = {"samples": samples, "examples": examples, "cache_stats_end": stats}
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
        """Stored responses; odd writers chain them with previous_response_id (chains of a few hops)."""
        rng, previous = random.Random(index), None
        while not self.stop.is_set():
            try:
                response = self.client.responses.create(
                    model=SERVED,
                    input=f"Writer {index}: {words(rng, 12)}",
                    max_output_tokens=8,
                    previous_response_id=previous if index % 2 == 1 else None,
                )
            except openai.APIError as error:
                with self.lock:
                    self.errors[type(error).__name__] += 1
                previous = None
                if isinstance(error, openai.APIConnectionError):
                    return  # the server is gone
                continue
            with self.lock:
                self.acks.append(acknowledged(response))
                previous = response.id if len(self.acks) % 4 else None


def acknowledged(response: Any) -> Acknowledged:
    output = [item.model_dump(mode="json") for item in response.output]
    return Acknowledged(
        id=response.id,
        status=str(response.status),
        output_text=response.output_text,
        output=output,
        previous_response_id=response.previous_response_id,
    )


def integrity(path: Path) -> str:
    connection = sqlite3.connect(path)
    try:
        return "; ".join(str(row[0]) for row in connection.execute("PRAGMA integrity_check").fetchall())
    finally:
        connection.close()


def run_kill(setup: Setup) -> PartResult:
    """Writers against a server that gets SIGKILL after --kill-after seconds; a copy of its data directory taken
    right after is checked; then a restart on it, where every acknowledged id must come back equal."""
    args = setup.args
    data_dir = setup.launcher.cache_dir / "reliability-kill-data"
    shutil.rmtree(data_dir, ignore_errors=True)
    flags = ["--data-dir", str(data_dir)]
    result, first = setup.part("kill", "bench.reliability --parts kill", flags)
    with first as server:
        traffic = KillTraffic(sync_client(server.base_url, CLIENT_TIMEOUT_S))
        writers = [threading.Thread(target=traffic.writer, args=(i,), daemon=True) for i in range(args.kill_writers)]
        for writer in writers:
            writer.start()
        time.sleep(args.kill_after)
        killed_code = server.stop(signal.SIGKILL, timeout=HTTP_TIMEOUT_S)
        progress(f"kill: SIGKILL after {args.kill_after:g} s with {len(traffic.acks)} acknowledged")
        for writer in writers:
            writer.join(HTTP_TIMEOUT_S)
        traffic.stop.set()
        traffic.client.close()
    acks = traffic.acks
    crash_copy = setup.launcher.cache_dir / "reliability-kill-data-at-crash"
    shutil.rmtree(crash_copy, ignore_errors=True)
    shutil.copytree(data_dir, crash_copy)
    crash_files = sorted(path.name for path in crash_copy.iterdir())
    integrity_at_crash = integrity(crash_copy / "courier.sqlite3")
    missing, different = [], []
    with setup.part("kill-restart", "", flags)[1] as server, sync_client(server.base_url, CLIENT_TIMEOUT_S) as client:
        for ack in acks:
            try:
                stored = acknowledged(client.responses.retrieve(ack.id))
            except openai.APIStatusError as error:
                missing.append(f"{ack.id}: {status_outcome(error)}")
                continue
            if stored != ack:
                different.append(ack.id)
        restart_exit = server.stop(signal.SIGTERM)
    integrity_after = integrity(data_dir / "courier.sqlite3")
    retrievable = len(acks) - len(missing)
    result.row("writers / SIGKILL after (s)", f"{args.kill_writers} / {args.kill_after:g}")
    result.row(
        "acknowledged (200 with a body)",
        f"{len(acks)} ({sum(bool(ack.previous_response_id) for ack in acks)} with previous_response_id)",
    )
    result.row("client errors at the kill", counts(traffic.errors))
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
    result.data = {"ids": [ack.id for ack in acks], "missing": missing, "different": different}
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


# ---------------------------------------------------------------- report and main


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


def print_report(
    env: dict[str, object], source: dict[str, object], settings: dict[str, object], parts: Sequence[PartResult]
) -> None:
    print("## Courier reliability\n")
    versions = ", ".join(f"{name} {env[name]}" for name in ("mlx", "mlx-lm", "courier", "openai"))
    print(f"- python {env['python']}, {versions}")
    print(f"- machine: {env['platform']} ({env['machine']}), {env['cpu_count']} CPUs")
    changed = source["courier_files_changed_from_head"]
    print(f"- source: HEAD {source['head']}" + (f", working tree differs in {changed}" if changed else ""))
    print(f"- model: tiny random-weight llama (tests/support/tiny_models.py), served as `{SERVED}`")
    print(f"- settings: {settings}\n")
    for part in parts:
        print(f"### {part.name}: {'PASS' if part.passed else 'FAIL'}\n")
        print(f"Command: `.venv/bin/python -m {part.command}`\n")
        for command in part.server_commands:
            print(f"Server: `{command}`\n")
        if part.error is not None:
            print(f"**Error:** {part.error}\n")
        if part.rows:
            table("figure | value", (f"{metric} | {value.replace('|', '/')}" for metric, value in part.rows))
        if part.checks:
            rows = (f"{c.name} | {'pass' if c.passed else 'FAIL'} | {c.detail.replace('|', '/')}" for c in part.checks)
            table("check | result | detail", rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(PARTS), help=f"parts to run ({','.join(PARTS)})")
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
    add("--log-dir", type=Path, default=None, help="server logs (default: CACHE/bench-logs)")
    cli.add_results(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blas = load_optimized_blas()  # before MLX is imported, as the server does
    parts: list[PartResult] = []
    with cache_directory(args.cache_dir) as cache_dir:
        log_dir = (args.log_dir or cache_dir / "bench-logs").resolve()
        progress("converting the embedded GGUF (the tiny model borrows its tokenizer)")
        model_dir = tiny_model("llama", prepare_4bit_dir(cache_dir), cache_dir)
        setup = Setup(
            launcher=Launcher(bench="reliability", cache_dir=cache_dir, log_dir=log_dir), model_dir=model_dir, args=args
        )
        for name in args.parts:
            progress(f"part {name}")
            try:
                parts.append(RUNNERS[name](setup))
            except Exception as error:  # one part's crash is reported, the others still run
                progress(f"{name}: FAILED: {type(error).__name__}: {error}")
                parts.append(
                    PartResult(
                        name=name, command=f"bench.reliability --parts {name}", error=f"{type(error).__name__}: {error}"
                    )
                )
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    env, source = environment(blas), source_state()
    print_report(env, source, settings, parts)
    write_json({"environment": env, "source": source, "settings": settings, "parts": parts}, args.json)
    return 0 if all(part.passed for part in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
