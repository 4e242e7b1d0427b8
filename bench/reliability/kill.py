"""The kill part: SIGKILL under stored-response writers, then a restart that must return every acknowledged
response."""

from __future__ import annotations

import random
import shutil
import signal
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from bench.harness.clients import sync_client
from bench.harness.report import counts, progress
from bench.reliability.common import (
    CLIENT_TIMEOUT_S,
    HTTP_TIMEOUT_S,
    SERVED,
    PartResult,
    Setup,
    status_outcome,
    words,
)


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
