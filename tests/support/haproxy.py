"""HAProxy for tests: check a configuration, run one in the foreground, read its servers' states, stop it.

It needs the `haproxy` binary (Debian: `apt-get install haproxy`; `./dev test` installs it when it runs as
root); without it `unavailable_reason()` says so and the tests that need one are skipped. Nothing
system-wide is touched: the process is started from a file in the test's directory, with `-db` (no
daemon), and stopped when the block ends. Its log (`log stdout`) goes to `haproxy.log` beside the file.
"""

from __future__ import annotations

import csv
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from courier.cluster.front_process import find_haproxy, unavailable_reason

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.02


def check_config(text: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """`haproxy -c` on `text`: returncode 0 when HAProxy accepts it; its findings in stdout and stderr."""
    binary = find_haproxy()
    assert binary is not None, unavailable_reason()
    path = directory / "check.cfg"
    path.write_text(text)
    return subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, check=False, timeout=30)


@dataclass(frozen=True, slots=True)
class RunningHaproxy:
    port: int
    log: Path
    stats_socket: Path

    def command(self, text: str) -> str:
        """One command on the admin socket (`show stat`, `disable server BACKEND/NAME`, ...) and its answer."""
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(str(self.stats_socket))
            connection.sendall(text.encode() + b"\n")
            return b"".join(iter(lambda: connection.recv(65536), b"")).decode()

    def server_states(self, backend: str) -> dict[str, str]:
        """Each server of `backend` and the status HAProxy gives it now ("UP", "DOWN", "UP 1/2", ...)."""
        rows = csv.DictReader(self.command("show stat").lstrip("# ").splitlines())
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_for(self, backend: str, wanted: Callable[[dict[str, str]], bool]) -> dict[str, str]:
        """Poll the servers' states until `wanted` holds (health checks run on HAProxy's clock, not ours)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not wanted(states := self.server_states(backend)):
            assert time.monotonic() < deadline, f"{backend}: {states}\n{self.log.read_text()}"
            time.sleep(POLL_S)
        return states


@contextmanager
def running_haproxy(text: str, directory: Path, port: int, stats_socket: Path) -> Iterator[RunningHaproxy]:
    """HAProxy serving `text` (which binds `port` and opens `stats_socket`), until the block ends."""
    binary = find_haproxy()
    assert binary is not None, unavailable_reason()
    config = directory / "haproxy.cfg"
    config.write_text(text)
    log = directory / "haproxy.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait_until_listening(process, port, stats_socket, log)
        yield RunningHaproxy(port=port, log=log, stats_socket=stats_socket)
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_listening(process: subprocess.Popen[bytes], port: int, stats_socket: Path, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, f"haproxy exited with {process.returncode}:\n{log.read_text()}"
        try:  # HAProxy names its admin socket before it listens on it: ready once both accept a connection
            with socket.create_connection(("127.0.0.1", port), timeout=1), socket.socket(socket.AF_UNIX) as admin:
                admin.settimeout(1)
                admin.connect(str(stats_socket))
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"haproxy did not listen on {port}:\n{log.read_text()}"
        time.sleep(POLL_S)
