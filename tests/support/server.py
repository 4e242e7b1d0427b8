"""A real `courier serve` subprocess on an ephemeral port, for end-to-end tests.

Start-up is observed through the server's own log lines ("listening on ...",
"ready: ..."), read by a thread into a queue, so tests wait on events rather
than sleeping.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Protocol

import httpx
import openai

from courier.cluster.replica_process import ChildProcess, new_interpreter
from tests.support.forked_servers import forkable
from tests.support.polling import attempts

LISTENING = re.compile(r"listening on (http://\S+)")
READY = re.compile(r"\bready: ")
# A log line at level ERROR (cli.py's format: "<date> <time> LEVEL logger: message"), or an uncaught traceback.
ERROR_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) |^Traceback ")
# The served model names of the session's shared servers (tests/conftest.py).
TINY_MODEL = "tiny-llama"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
# Every prompt prefilled in whole `--prefill-step-size` chunks instead of chunks sized from the steps' timed cost: a
# server whose tests compare the greedy replies of two requests (or two servers) needs it, since other chunkings move
# float32 logits (~2e-6 on a tiny random model) and flip a near-tied token as the machine's load changes the timing.
FIXED_PREFILL_CHUNKS = ("--prefill-stall-ms", "0")


class ServerExited(RuntimeError):
    pass


class ServerProcess(Protocol):
    """A `courier serve` process: a `subprocess.Popen`, or one forked by the launcher (`forked_servers.py`)."""

    pid: int
    returncode: int | None

    @property
    def stderr(self) -> IO[str] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class RunningServer:
    def __init__(self, process: ServerProcess) -> None:
        self.process = process
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.base_url = ""

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        """Block until a log line matches `pattern`; fail if the server exits first."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no log line matching {pattern.pattern!r} within {timeout} s") from None
            if line is None:
                raise ServerExited(f"server exited ({self.process.wait()}):\n{self.log()}")
            if match := pattern.search(line):
                return match

    def log(self) -> str:
        return "".join(self.lines)

    def logged(self, pattern: re.Pattern[str], since: int = 0, timeout: float = 60.0) -> re.Match[str]:
        """The first log line from index `since` of `lines` on that matches `pattern`, polled for until `timeout`
        (unlike `wait_for`, it leaves the queue of lines alone, so lines may be looked for in any order)."""
        for _ in attempts(timeout):
            if found := next(filter(None, map(pattern.search, self.lines[since:])), None):
                return found
        raise TimeoutError(f"no log line matching {pattern.pattern!r} within {timeout} s:\n{self.log()[-4000:]}")

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="not-needed", max_retries=0)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """The exit code of a server already told to stop (a second signal would force it)."""
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout)
        return code


def error_lines(server: RunningServer) -> list[str]:
    """The log lines of `server` at level ERROR or above, and the first lines of uncaught tracebacks."""
    return [line for line in server.lines if ERROR_LINE.search(line)]


ROOT = Path(__file__).resolve().parents[2]  # where `courier serve` runs: the checkout


def server_environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """This process's environment without its Courier and OpenTelemetry settings, then the test's `env`."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("COURIER_", "OTEL_"))}
    environment.update(env or {})
    return environment


def server_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "courier", "serve", "--port", "0", *args]


@contextmanager
def running_server(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    wait_ready: bool = True,
    launcher: Callable[[list[str]], list[str]] | None = None,
) -> Iterator[RunningServer]:
    """`launcher`: turns the server's command line into the one to run (e.g. inside a mount namespace)."""
    environment = server_environment(env)
    # Stored responses and the prompt cache's disk tier go to fresh directories unless the test chose them: a
    # server never starts warm from another test's snapshots.
    data_dir = None
    if "--data-dir" not in args and "COURIER_DATA_DIR" not in environment:
        data_dir = tempfile.TemporaryDirectory(prefix="courier-data-")
        environment["COURIER_DATA_DIR"] = data_dir.name
    prompt_cache_dir = None
    if "--prompt-cache-dir" not in args and "COURIER_PROMPT_CACHE_DIR" not in environment:
        prompt_cache_dir = tempfile.TemporaryDirectory(prefix="courier-prompt-cache-")
        environment["COURIER_PROMPT_CACHE_DIR"] = prompt_cache_dir.name
    command = server_command(args)
    process: ServerProcess
    serve_args = command[command.index("serve") + 1 :]
    if launcher is None and (forks := forkable(serve_args, env or {}, ROOT)) is not None:
        process = forks.start(serve_args, environment, ROOT)  # the same `courier serve`, its imports done once
    else:
        process = subprocess.Popen(
            launcher(command) if launcher else command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=ROOT,
        )
    server = RunningServer(process)
    try:
        server.base_url = server.wait_for(LISTENING).group(1)
        if wait_ready:
            server.wait_for(READY)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()
        for directory in (data_dir, prompt_cache_dir):
            if directory is not None:
                directory.cleanup()


def run_to_exit(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """`courier serve <args>` run until it exits by itself (a start-up that fails): its exit code and standard
    error. Forked where `running_server` would fork it (the failures come after the imports), else a fresh
    interpreter."""
    environment = server_environment(env)
    command = server_command(args)
    serve_args = command[command.index("serve") + 1 :]
    if (forks := forkable(serve_args, env or {}, ROOT)) is None:
        return subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False, env=environment, cwd=ROOT
        )
    process = forks.start(serve_args, environment, ROOT)
    assert process.stderr is not None
    try:
        stderr = process.stderr.read()
        return subprocess.CompletedProcess(command, process.wait(timeout_s), "", stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def forked_replica(serve_args: Sequence[str], log: IO[bytes], environ: Mapping[str, str]) -> ChildProcess:
    """A cluster's replica (`LocalCluster(..., starter=forked_replica)`) forked by the launcher, as test servers
    are; in a fresh interpreter where a variable the imports read differs from this process's."""
    # What the cluster set, or changed since it copied this environment; pytest renames the running test as it goes.
    changed = {
        key: value for key, value in environ.items() if os.environ.get(key) != value and key != "PYTEST_CURRENT_TEST"
    }
    if (forks := forkable(serve_args, changed, ROOT)) is None:
        return new_interpreter(serve_args, log, environ)
    return forks.start_logged(serve_args, environ, ROOT, log)


@contextmanager
def serving(model_dir: Path, cache_dir: Path, name: str, *extra: str) -> Iterator[RunningServer]:
    """A server for `model_dir` as `name`, stopped cleanly (exit code 0) when the block ends."""
    with running_server(
        ["--model", str(model_dir), "--cache-dir", str(cache_dir), "--served-model-name", name, *extra]
    ) as running:
        yield running
        assert running.stop() == 0
