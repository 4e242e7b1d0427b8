"""The front of a local cluster: HAProxy in the foreground (`-db`) on a generated configuration, with an admin socket.

The socket answers `show stat`, which is how the cluster knows the front sees every replica up
before it prints its URL, and how an operator (or a test) reads which replicas it routes to.
"""

from __future__ import annotations

import csv
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from courier.cluster.haproxy_config import BACKEND

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05


class FrontError(RuntimeError):
    """HAProxy is missing, refused its configuration, or ended."""


def find_haproxy() -> str | None:
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin:/opt/homebrew/sbin")


def unavailable_reason() -> str | None:
    if find_haproxy() is None:
        return "HAProxy is not installed: Debian/Ubuntu: apt-get install haproxy; macOS: brew install haproxy"
    return None


@dataclass(slots=True)
class FrontProcess:
    config_text: str  # binds `port` and opens `stats_socket`
    port: int
    directory: Path
    stats_socket: Path  # the configuration's `stats socket`: a short path (HAProxy takes 97 characters)
    host: str = "127.0.0.1"  # where it listens: the bind address, or loopback for a wildcard bind
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def config_path(self) -> Path:
        return self.directory / "haproxy.cfg"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def log_path(self) -> Path:
        return self.directory / "haproxy.log"

    def start(self) -> None:
        """Check the configuration, start HAProxy and wait until it listens."""
        binary = find_haproxy()
        if binary is None:
            raise FrontError(unavailable_reason() or "HAProxy is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text)
        command = [binary, "-c", "-f", str(self.config_path)]
        check = subprocess.run(command, capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise FrontError(f"HAProxy refused its configuration: {check.stdout}{check.stderr}")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [binary, "-db", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._listening():
            if not self.is_running():
                raise FrontError(f"HAProxy exited with {self._process.poll()}:\n{self.log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise FrontError(f"HAProxy did not listen on port {self.port} within {START_TIMEOUT_S:g} s")
            time.sleep(POLL_S)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def server_states(self) -> dict[str, str]:
        """Each replica's server and the status HAProxy gives it now ("UP", "DOWN", "UP 1/2", "MAINT", ...)."""
        rows = csv.DictReader(self.command("show stat").lstrip("# ").splitlines())
        return {
            row["svname"]: row["status"]
            for row in rows
            if row["pxname"] == BACKEND and row["svname"] not in ("FRONTEND", "BACKEND")
        }

    def wait_until_up(self, names: set[str], timeout_s: float) -> None:
        """Block until HAProxy's health checks mark each of `names` UP (they run on HAProxy's clock)."""
        deadline = time.monotonic() + timeout_s
        while not all((states := self.server_states()).get(name) == "UP" for name in names):
            if time.monotonic() > deadline:
                raise FrontError(f"replicas not up in the front within {timeout_s:g} s: {states}")
            time.sleep(POLL_S)

    def command(self, text: str) -> str:
        """One command on the admin socket and its answer."""
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(str(self.stats_socket))
            connection.sendall(text.encode() + b"\n")
            return b"".join(iter(lambda: connection.recv(65536), b"")).decode()

    def soft_stop(self) -> None:
        """Stop listening, but pass on what the open connections still exchange (HAProxy's SIGUSR1)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGUSR1)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _listening(self) -> bool:
        try:  # HAProxy names its admin socket before it listens on it: up once both accept a connection
            with socket.create_connection((self.host, self.port), timeout=1), socket.socket(socket.AF_UNIX) as admin:
                admin.settimeout(1)
                admin.connect(str(self.stats_socket))
                return True
        except OSError:
            return False
