"""One replica of a local cluster: a `courier serve` child process on a fixed loopback port, its log in a file.

The port, the replica id and the prompt-cache directory stay the same across restarts, so the front's
server line keeps pointing at it, response ids it minted before still name it, and its disk tier
(each replica has its own: a directory serves one process) brings its conversations back warm. The
storage URL goes through the environment, not argv, where any local user could read its password.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

HEALTH_POLL_S = 0.2
HEALTH_TIMEOUT_S = 2.0
LOG_TAIL_BYTES = 4000
# Loopback needs no proxy, whatever http_proxy says.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ReplicaExited(RuntimeError):
    """The replica's process ended while it was awaited; the message holds the end of its log."""


class ChildProcess(Protocol):
    """What a replica needs of its process: `subprocess.Popen`'s, or another starter's with the same meaning."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...  # subprocess.TimeoutExpired past `timeout`

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# Starts `courier serve <serve_args>` with `environ`, its output appended to `log`.
ReplicaStarter = Callable[[Sequence[str], IO[bytes], Mapping[str, str]], ChildProcess]


def new_interpreter(serve_args: Sequence[str], log: IO[bytes], environ: Mapping[str, str]) -> ChildProcess:
    """The replica in a Python interpreter of its own, in a session of its own (a Ctrl-C at the terminal reaches
    `courier cluster up`, which stops the replicas itself)."""
    return subprocess.Popen(
        [sys.executable, "-m", "courier", "serve", *serve_args],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(environ),
        start_new_session=True,
    )


@dataclass(slots=True)
class ReplicaProcess:
    name: str  # its --replica-id, and its server's name in the front
    port: int
    directory: Path  # its log and prompt cache
    serve_args: Sequence[str]  # `courier serve` flags besides those the cluster sets
    environ: Mapping[str, str]
    api_prefix: str = ""
    starter: ReplicaStarter = new_interpreter
    starts: int = 0
    _process: ChildProcess | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "courier.log"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def arguments(self) -> list[str]:
        """Its `courier serve` flags."""
        cache = self.directory / "prompt-cache"
        own = ["--host", "127.0.0.1", "--port", str(self.port), "--replica-id", self.name]
        return [*own, "--prompt-cache-dir", str(cache), *self.serve_args]

    def start(self) -> None:
        """Start the process (not waiting for it to be ready); its output is appended to `log_path`."""
        assert not self.is_running(), f"replica {self.name} is already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._process = self.starter(self.arguments(), log, self.environ)
        self.starts += 1

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_code(self) -> int | None:
        """The code the last process ended with; None while it runs or before any start."""
        return None if self._process is None else self._process.poll()

    def wait_ready(self, timeout_s: float) -> None:
        """Block until /health answers 200; `ReplicaExited` if the process ends first, TimeoutError past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.ready_or_raise(deadline):
            time.sleep(HEALTH_POLL_S)

    def ready_or_raise(self, deadline: float) -> bool:
        """Whether /health answers 200 now; `ReplicaExited` if the process has ended, TimeoutError past `deadline`."""
        if self._healthy():
            return True
        if not self.is_running():
            raise ReplicaExited(f"replica {self.name} exited with {self.exit_code()}:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica {self.name} was not ready in time:\n{self.log_tail()}")
        return False

    def signal(self, number: int) -> None:
        """Send `number` (SIGTERM drains, SIGKILL is a crash) to the running process."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(number)

    def wait(self, timeout_s: float) -> int:
        """The exit code once the process ends; after `timeout_s` it is killed."""
        assert self._process is not None
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait()

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the replica drains its requests), then SIGKILL after `timeout_s`; None if it was not started."""
        if self._process is None:
            return None
        self.signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def log_tail(self) -> str:
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(max(0, os.path.getsize(self.log_path) - LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")

    def _healthy(self) -> bool:
        try:
            with _DIRECT.open(f"{self.url}{self.api_prefix}/health", timeout=HEALTH_TIMEOUT_S) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False
