"""`courier cluster up` as a user runs it: its URL serves, a killed replica comes back, Ctrl-C stops it all."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from courier.cluster import front_process, local_postgres
from tests.support.ports import free_port

pytestmark = [
    pytest.mark.e2e,  # `courier cluster up` in a subprocess
    pytest.mark.skipif(
        bool(reason := local_postgres.unavailable_reason() or front_process.unavailable_reason()), reason=reason or ""
    ),
]

MODEL = "tiny-llama"
SUMMARY_END = "Ctrl-C stops everything."
REPLICA_LINE = re.compile(r"replica (r\d+): (http://\S+) \(pid (\d+), log (\S+)\)")
BACK_TIMEOUT_S = 120.0
POLL_S = 0.1


def cluster_up(*args: str) -> subprocess.Popen[str]:
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("COURIER_", "OTEL_"))}
    command = [sys.executable, "-m", "courier", "cluster", "up", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)


@pytest.fixture
def running(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    port = free_port()
    serve = ["--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    process = cluster_up("--replicas", "1", "--port", str(port), "--model", str(tiny_llama_dir), "--", *serve)
    assert process.stdout is not None
    summary = []
    while (line := process.stdout.readline()) and line.strip() != SUMMARY_END:
        summary.append(line)
    try:
        assert line, f"cluster up exited with {process.wait()}:\n{''.join(summary)}{process.communicate()[1]}"
        yield process, summary
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_url_serves_a_killed_replica_comes_back_and_ctrl_c_stops_everything(
    running: tuple[subprocess.Popen[str], list[str]],
) -> None:
    process, summary = running
    url = re.search(r"behind (http://\S+)/v1", summary[0])
    replica = REPLICA_LINE.search("".join(summary))
    storage = re.search(r"storage: postgresql://\S+@(127\.0\.0\.1:\d+)/", "".join(summary))
    assert url and replica and storage, summary
    assert "courier:***@" in "".join(summary)  # the database's password is never printed
    name, replica_url, pid = replica.group(1), replica.group(2), int(replica.group(3))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.post(f"{url.group(1)}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-courier-replica"] == name

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while not _healthy(replica_url):  # started again by the cluster, on the same port
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(POLL_S)

    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors
    assert f"replica {name} exited with -9; starting it again" in errors
    for address in (url.group(1), replica_url, f"http://{storage.group(1)}"):
        host, port = address.removeprefix("http://").split(":")
        with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
            pass
    directory = Path(replica.group(4)).parents[1]
    postgres_dir = re.search(r"starting PostgreSQL in (\S+)", errors)
    assert postgres_dir, errors
    assert not directory.exists() and not Path(postgres_dir.group(1)).exists()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds leftover processes in /proc")
def test_a_signal_while_it_starts_stops_what_started_and_leaves_nothing(tiny_llama_dir: Path, cache_dir: Path) -> None:
    serve = ["--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    process = cluster_up("--replicas", "2", "--port", str(free_port()), "--model", str(tiny_llama_dir), "--", *serve)
    assert process.stderr is not None
    postgres_dir = None
    for line in process.stderr:
        if found := re.search(r"starting PostgreSQL in (\S+)", line):
            postgres_dir = found.group(1)
        if "loading the model" in line:
            process.send_signal(signal.SIGTERM)
            break
    _, errors = process.communicate(timeout=120)
    assert process.returncode == 1, errors
    assert "stopped while starting" in errors
    assert postgres_dir is not None and not Path(postgres_dir).exists()
    assert not [pid for pid in _pids() if postgres_dir in _command_line(pid)], "a process of the cluster is left"


def test_flags_the_cluster_sets_itself_are_refused() -> None:
    process = cluster_up("--replicas", "1", "--", "--port", "9000")
    _, errors = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "the cluster sets --port for each replica itself" in errors


def test_a_front_port_in_use_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = cluster_up("--replicas", "1", "--port", str(taken.getsockname()[1]))
        _, errors = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "is in use" in errors and "starting PostgreSQL" not in errors


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _command_line(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
