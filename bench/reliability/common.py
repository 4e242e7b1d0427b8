"""What every part of the reliability bench shares: its result and checks, the server it starts, /health and
/proc readings, and one streamed chat completion."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from bench.harness.report import ms
from bench.harness.servers import COURIER, Launcher, Server, ServerSpec
from bench.harness.stats import percentile_or_none

PARTS = ("load", "disconnects", "soak", "kill", "shutdown", "storm")
SERVED = "tiny-llama"
REPO_ROOT = Path(__file__).resolve().parents[2]
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
