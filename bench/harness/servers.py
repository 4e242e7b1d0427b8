"""The servers a bench measures: Courier (this tree's, or another commit's) and mlx_lm.server, on free ports.

A `ServerSpec` says what to start, a `Launcher` how (the run's cache and log directories, OpenBLAS for the float32
peers, the baseline tree); entering a `Server` starts its process and waits until its ready path answers 200 (at
most READY_TIMEOUT_S), leaving stops it (SIGTERM, then SIGKILL). Its output goes to a log file and stays in memory
(`lines`). `Launcher.run` does all that around one measurement and keeps a failure in the `ServerRecord`.

Every Courier gets a fresh data and prompt-cache directory (environment variables, so a baseline tree that lacks
the flags ignores them) unless its flags name one: no server starts warm from another run's state.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx
import openai

from bench.harness.report import progress

HOST = "127.0.0.1"
COURIER = "courier"
COURIER_BASELINE = "courier-baseline"  # Courier imported from --baseline-tree DIR, started like `courier`
MLX_LM_4BIT = "mlx-lm-4bit"  # mlx_lm.server as shipped, on the 4-bit conversion of the embedded GGUF
MLX_LM_F32 = "mlx-lm-f32"  # on the same weights in float32 with OpenBLAS preloaded
MLX_LM_F32_KERNELS = "mlx-lm-f32-kernels"  # the same, given the OpenBLAS kernels Courier chose
F32_KINDS = (MLX_LM_F32, MLX_LM_F32_KERNELS)
COURIER_MODEL_ID = "SmolLM2-135M-Instruct"
MLX_LM_MODEL_ID = "default_model"  # mlx_lm.server's name for its --model
OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
READY_TIMEOUT_S = 300.0
READY_POLL_S = 0.5
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 3000
QUIET_POLL_S = 30.0
T = TypeVar("T")


class BenchmarkError(RuntimeError):
    """A server did not start, answer or stream as expected; the message says how."""


# What fails one server's measurement (recorded, and the bench goes on with the next).
RUN_ERRORS = (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError, TimeoutError)


def is_courier(kind: str) -> bool:
    return kind in (COURIER, COURIER_BASELINE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSpec:
    """What to start: `kind` (one of the names above; `name` when empty) says how, `name` what reports call it.
    Courier serves `model_dir` as `served_name` (the embedded SmolLM2 when None); mlx_lm.server needs `model_dir`."""

    name: str
    kind: str = ""
    model_dir: Path | None = None
    served_name: str | None = None
    flags: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        return self.kind or self.name

    @property
    def is_courier(self) -> bool:
        return is_courier(self.how)

    @property
    def model(self) -> str:
        """The model id requests name."""
        if not self.is_courier:
            return MLX_LM_MODEL_ID
        return self.served_name or COURIER_MODEL_ID

    @property
    def ready_path(self) -> str:
        return "/health" if self.is_courier else "/v1/models"


@dataclass(slots=True, kw_only=True)
class ServerRecord:
    """One server process, for the report: how it was started, how long it took to be ready, how it ended."""

    name: str
    command: list[str]
    extra_env: dict[str, str]
    log_path: str
    ready_s: float | None = None
    error: str | None = None
    stop_signal: str | None = None  # when the bench stopped it itself: the signal, the wait, the exit status
    stop_s: float | None = None
    exit_code: int | None = None

    def command_text(self) -> str:
        """The environment it got on top of ours and its command, its port and prompt-cache directory written as
        PORT and DIR (so that runs differing only there print alike)."""
        words = list(self.command)
        for flag, stand_in in (("--port", "PORT"), ("--prompt-cache-dir", "DIR")):
            if flag in words:
                words[words.index(flag) + 1] = stand_in
        env = " ".join(f"{key}={value}" for key, value in self.extra_env.items())
        return (env + " " if env else "") + shlex.join(words)

    def line(self, note: str = "") -> str:
        """A Markdown list item: name, command, how its start went (and `note`)."""
        status = f"ready in {self.ready_s:.1f} s" if self.ready_s is not None else "not ready"
        failed = f"; FAILED: {self.error}" if self.error else ""
        return f"- `{self.name}`: `{self.command_text()}` ({status}{failed}{note})"


class Server:
    """A server process: `with server:` starts it and waits until it is ready; leaving stops it."""

    def __init__(self, spec: ServerSpec, record: ServerRecord, env: dict[str, str], port: int) -> None:
        self.spec = spec
        self.record = record
        self.port = port
        self.base_url = f"http://{HOST}:{port}"
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self._env = env
        self._scratch: list[tempfile.TemporaryDirectory[str]] = []
        self._reader: threading.Thread | None = None

    def __enter__(self) -> Server:
        try:
            self.start()
            self.record.ready_s = self.wait_ready()
        except BaseException:
            self.close()
            raise
        progress(f"{self.spec.name}: ready after {self.record.ready_s:.1f} s")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not started"
        return self.process.pid

    def poll(self) -> int | None:
        """The exit status once the process has ended, else None."""
        return self.process.poll() if self.process is not None else None

    def start(self) -> None:
        env = dict(self._env)
        if self.spec.is_courier:  # fresh state directories unless the command or the environment names them
            for flag, variable in (
                ("--data-dir", "COURIER_DATA_DIR"),
                ("--prompt-cache-dir", "COURIER_PROMPT_CACHE_DIR"),
            ):
                if flag not in self.record.command and variable not in env:
                    scratch = tempfile.TemporaryDirectory(prefix=f"bench-{variable.lower()}-")
                    self._scratch.append(scratch)
                    env[variable] = scratch.name
        log_path = Path(self.record.log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        progress(f"{self.spec.name}: starting {self.record.command_text()} (log: {log_path})")
        self.process = subprocess.Popen(
            self.record.command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        self._reader = threading.Thread(target=self._read, args=(self.process, log_path), daemon=True)
        self._reader.start()

    def _read(self, process: subprocess.Popen[str], log_path: Path) -> None:
        assert process.stdout is not None
        with log_path.open("w") as log:
            for line in process.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()

    def wait_ready(self) -> float:
        """Poll the ready path until it answers 200; the seconds it took."""
        started = time.monotonic()
        problem = "no answer yet"
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() - started < READY_TIMEOUT_S:
                if self.process is None or self.process.poll() is not None:
                    code = self.process.returncode if self.process else None
                    raise BenchmarkError(f"server exited with {code} before it was ready:\n{self.log_tail()}")
                try:
                    response = http.get(self.base_url + self.spec.ready_path)
                    if response.status_code == 200:
                        return time.monotonic() - started
                    problem = f"HTTP {response.status_code}"
                except httpx.HTTPError as error:
                    problem = f"{type(error).__name__}: {error}"
                time.sleep(READY_POLL_S)
        raise BenchmarkError(
            f"{self.spec.ready_path} not ready after {READY_TIMEOUT_S:.0f} s ({problem}):\n{self.log_tail()}"
        )

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` and wait for the exit (recorded): its status. Past `timeout` the process is killed."""
        assert self.process is not None, "the server is not started"
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            self.process.kill()
            self.process.wait()
            raise BenchmarkError(f"{self.spec.name}: still running {timeout:.0f} s after {sig.name}") from expired
        self.record.stop_signal, self.record.stop_s, self.record.exit_code = sig.name, time.monotonic() - started, code
        progress(f"{self.spec.name}: {sig.name}: exited with {code} after {self.record.stop_s:.2f} s")
        self._join()
        return code

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """The exit status of a server already told to stop (a second signal could force it)."""
        assert self.process is not None, "the server is not started"
        code = self.process.wait(timeout=timeout)
        self._join()
        return code

    def close(self) -> None:
        """Stop the process if it still runs (SIGTERM, then SIGKILL) and clean up after it."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._join()
        for scratch in self._scratch:
            scratch.cleanup()
        self._scratch.clear()

    def _join(self) -> None:
        if self._reader is not None:
            self._reader.join(STOP_TIMEOUT_S)

    def log(self) -> str:
        return "".join(self.lines)

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL_CHARS:]

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process, all its threads (0 once it is gone)."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True, kw_only=True)
class Launcher:
    """How this run starts servers: the model cache Courier gets (`--cache-dir`), where logs go (`<bench>-<name>.log`),
    OpenBLAS and its kernels for the float32 peers, and the tree courier-baseline imports."""

    bench: str
    cache_dir: Path
    log_dir: Path
    openblas: str = OPENBLAS_PATH
    kernels: str | None = None
    baseline_tree: Path | None = None
    records: list[ServerRecord] = field(default_factory=list)

    def server(self, spec: ServerSpec, log_name: str | None = None) -> Server:
        """A server for `spec` (not started yet: enter it), its record kept in `records`."""
        port = free_port()
        extra = self.extra_env(spec)
        env = {key: value for key, value in os.environ.items() if key not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
        record = ServerRecord(
            name=spec.name,
            command=self.command(spec, port),
            extra_env=extra,
            log_path=str(self.log_dir / f"{self.bench}-{log_name or spec.name}.log"),
        )
        self.records.append(record)
        return Server(spec, record, env | extra, port)

    def run(
        self,
        spec: ServerSpec,
        measure: Callable[[Server], T],
        *,
        log_name: str | None = None,
        stop: signal.Signals | None = None,
    ) -> tuple[ServerRecord, T | None]:
        """Start `spec`, `measure` it, stop it (with `stop`, waited for and recorded, when given); a failure is
        kept in the record, and what `measure` returned (None after a failure)."""
        server = self.server(spec, log_name)
        result: T | None = None
        try:
            with server:
                result = measure(server)
                if stop is not None:
                    server.stop(stop, timeout=READY_TIMEOUT_S)
        except RUN_ERRORS as error:
            server.record.error = f"{type(error).__name__}: {error}"
            progress(f"{log_name or spec.name}: FAILED: {server.record.error}")
            return server.record, None
        return server.record, result

    def command(self, spec: ServerSpec, port: int) -> list[str]:
        if spec.is_courier:
            # Our Python, from the working directory: the tree the bench runs from is the tree it measures. For
            # courier-baseline with -P, so the working directory is not first on sys.path and the baseline tree on
            # PYTHONPATH is where `courier` comes from.
            launcher = [sys.executable, *(["-P"] if spec.how == COURIER_BASELINE else []), "-m", "courier"]
            command = [*launcher, "serve", "--port", str(port), "--cache-dir", str(self.cache_dir)]
            if spec.model_dir is not None:
                command += ["--model", str(spec.model_dir), "--served-model-name", spec.model]
        else:
            command = [sys.executable, "-m", "mlx_lm.server", "--model", str(spec.model_dir), "--port", str(port)]
        return command + list(spec.flags)

    def extra_env(self, spec: ServerSpec) -> dict[str, str]:
        """What a server gets on top of our environment (which loses LD_PRELOAD and OPENBLAS_CORETYPE). Courier picks
        its BLAS itself. mlx_lm.server's /v1/models lists the Hugging Face hub cache and fails mid-answer when there
        is none, so it gets an empty one of its own."""
        if spec.how == COURIER_BASELINE:
            if self.baseline_tree is None:
                raise BenchmarkError(f"{COURIER_BASELINE} needs --baseline-tree DIR")
            return {"PYTHONPATH": str(self.baseline_tree)}
        if spec.is_courier:
            return {}
        hub_cache = self.cache_dir / "bench-hf-hub"
        hub_cache.mkdir(parents=True, exist_ok=True)
        extra = {"HF_HUB_CACHE": str(hub_cache)}
        if spec.how in F32_KINDS:
            extra["LD_PRELOAD"] = self.openblas
        if spec.how == MLX_LM_F32_KERNELS and self.kernels:
            extra["OPENBLAS_CORETYPE"] = self.kernels
        return extra


def start_all(launcher: Launcher, specs: Sequence[ServerSpec], stack: ExitStack) -> dict[str, Server]:
    """Start each server in turn, kept up until `stack` closes; one that fails to start is recorded and left out."""
    live = {}
    for spec in specs:
        server = launcher.server(spec)
        try:
            live[spec.name] = stack.enter_context(server)
        except RUN_ERRORS as error:
            server.record.error = f"{type(error).__name__}: {error}"
            progress(f"{spec.name}: FAILED: {server.record.error}")
    return live


def tuned_flags(clients: int) -> tuple[str, ...]:
    """mlx_lm.server tuned for a burst of `clients` streams: all of them in one decode batch, their prompts
    prefilled together (the defaults are 32 and 8), and no INFO line per prompt."""
    return ("--decode-concurrency", str(clients), "--prompt-concurrency", str(clients), "--log-level", "WARNING")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def check_baseline_tree(tree: Path) -> None:
    """Fail unless courier-baseline, started as it will be, imports the `courier` package of `tree`."""
    import courier  # this tree's, as the bench imports it

    expected = (tree / "courier" / "__init__.py").resolve()
    if expected == Path(courier.__file__).resolve():
        raise BenchmarkError(f"--baseline-tree {tree} is this checkout; give another commit's tree")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    probe = [sys.executable, "-P", "-c", "import courier; print(courier.__file__)"]
    try:
        found = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise BenchmarkError(f"cannot run {shlex.join(probe)}: {error}") from error
    if found.returncode != 0:
        raise BenchmarkError(f"cannot import courier from --baseline-tree {tree}:\n{found.stderr[-LOG_TAIL_CHARS:]}")
    imported = Path(found.stdout.strip()).resolve()
    if imported != expected:
        raise BenchmarkError(f"{COURIER_BASELINE} would import courier from {imported}, not from {expected}")


def tree_commit(tree: Path) -> str | None:
    """The commit checked out in `tree` (None when git cannot tell)."""
    try:
        command = ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]
        found = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError:
        return None
    return found.stdout.strip() or None


def baseline_ready(tree: Path | None, servers: Sequence[str]) -> bool:
    """Check, before anything is measured, that courier-baseline (if it runs) will import the baseline tree."""
    if tree is None or COURIER_BASELINE not in servers:
        return True
    try:
        check_baseline_tree(tree)
    except BenchmarkError as error:
        progress(f"{COURIER_BASELINE}: {error}")
        return False
    progress(f"{COURIER_BASELINE}: courier from {tree} (commit {tree_commit(tree) or 'unknown'})")
    return True


def openblas_missing(path: str, needed: bool, leave_out: str) -> bool:
    """True (and says so) when a float32 peer will run and OpenBLAS is not at `path`."""
    if needed and not Path(path).is_file():
        progress(f"OpenBLAS not found at {path}; pass --openblas PATH or {leave_out}")
        return True
    return False


def load_average() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_for_quiet(max_load: float | None, timeout_s: float) -> tuple[float | None, float]:
    """Wait until the 1-minute load average is below `max_load` (None: don't wait); the load then and the wait."""
    started = time.monotonic()
    load = load_average()
    while max_load is not None and load is not None and load >= max_load:
        if time.monotonic() - started >= timeout_s:
            progress(f"load {load:.2f} still >= {max_load} after {timeout_s:.0f} s; measuring anyway")
            break
        progress(f"load {load:.2f} >= {max_load}; waiting {QUIET_POLL_S:.0f} s")
        time.sleep(QUIET_POLL_S)
        load = load_average()
    return load, time.monotonic() - started
