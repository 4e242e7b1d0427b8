"""Serving throughput of Courier against mlx-lm, side by side on the embedded SmolLM2-135M-Instruct.

Two measurements, in one run and on the same checkpoint:

1. Single-stream decode. The reference is mlx-lm's `stream_generate` in this process on the
   weights Courier serves on this device (`--weights auto`): on a CPU the 4-bit conversion of the
   embedded GGUF dequantized to float32, OpenBLAS loaded before MLX; on a GPU that conversion as
   stored (`--weights float32` or `stored` picks one), reported as mlx-lm's `generation_tps`. Each server
   then gets the same prompts as one streaming chat completion at a time over HTTP, each prompt
   run in process just before (the model stays loaded here; the server idles meanwhile), so each
   pair sees the same machine; its decode rate is (completion tokens - 1) / (last content delta -
   first content delta). The ratio HTTP / paired in-process medians is the cost of serving
   (Courier's target: >= 0.95). mlx-lm's figure
   counts one token more over the same interval, so the ratio errs against the server.

2. Concurrency sweep. N streaming clients (the official `openai` client, distinct prompts,
   `max_tokens` completion tokens each, temperature 0) start together; aggregate tok/s is all
   completion tokens / (first request sent .. last stream done), TTFT is request sent .. first
   content delta, reported as p50 and p95. Servers, one at a time:

   - `courier`: `courier serve --port P --cache-dir C`, out of the box (embedded model; on CPU
     it loads OpenBLAS itself and serves float32 weights).
   - `mlx-lm-4bit`: `python -m mlx_lm.server --model DIR4 --port P`, as shipped: the 4-bit MLX
     conversion of the embedded GGUF on MLX's bundled BLAS.
   - `mlx-lm-f32`: the same weights dequantized to float32 in their own model directory,
     served by `mlx_lm.server` with `LD_PRELOAD=<OpenBLAS>` and `--decode-concurrency` and
     `--prompt-concurrency` set to the largest client count (so every stream of a burst joins
     one decode batch and all its prompts prefill together; the defaults are 32 and 8), and
     `--log-level WARNING` (drops the INFO lines it logs for every prompt it processes).
     `OPENBLAS_CORETYPE` is removed from its environment: OpenBLAS picks its kernels itself,
     as in the issue's measurement (on this CPU Debian's OpenBLAS 0.3.21 picks `Prescott`).
   - `mlx-lm-f32-kernels`: the same, plus `OPENBLAS_CORETYPE` set to the kernels Courier's
     loader chose (`Cooperlake` here): the peer on equal BLAS kernels, for the record.
   - `courier-baseline` (only with `--baseline-tree DIR`, and then by default): Courier at
     another commit, DIR being a checkout of it (`git worktree add /tmp/courier-baseline
     COMMIT`), to show that a change is not slower. The same command and flags as `courier`,
     run as `PYTHONPATH=DIR python -P -m courier serve ...` out of the same virtualenv (`-P`
     keeps the working directory, which holds this tree's `courier`, off the front of
     sys.path); at start-up the script checks that this imports DIR's package and stops if
     not. It is measured exactly like `courier` and runs next to it (after it, or before it
     when listed first in `--servers`), so drift on a noisy machine hits both alike (not
     interleaved level by level: that would need both servers resident at once, and
     Courier's idle work after a burst would land in the other's measurement). The report
     adds "courier / courier-baseline" lines: single-stream decode, and aggregate tok/s and
     TTFT p95 at each concurrency level.

   Both mlx_lm.server runs get `HF_HUB_CACHE` set to an empty directory of their own: its
   `/v1/models` lists the hub cache and fails mid-answer when there is none.

   Each server gets one warm-up request before anything is measured. The targets: Courier's
   aggregate at 8 streams >= 1.3x the tuned mlx-lm server and >= 5x the as-shipped one, with a
   lower TTFT p95 than both.

Everything runs on 127.0.0.1; each server is started on a free port, polled until ready
(`GET /health` for Courier, `GET /v1/models` for mlx_lm.server; at most 300 s), measured and
stopped before the next one starts. From the repository root:

    .venv/bin/python -m bench.throughput [--concurrency 1,4,8,16] [--max-tokens 32]
        [--servers courier,mlx-lm-4bit,mlx-lm-f32] [--cache-dir DIR] [--json PATH]
        [--quiet-load 0.6 --quiet-timeout 900] [--baseline-tree /tmp/courier-baseline]
        [--weights auto|float32|stored]

On a shared machine, `--quiet-load L` waits before each server until the 1-minute load
average is below L (polling every 30 s, at most `--quiet-timeout` seconds, then going on
anyway); the load each server started under is reported beside it.

Markdown tables go to stdout, progress to stderr. Server logs go to CACHE/bench-logs (kept when --cache-dir is given).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from courier.platform.blas import BlasReport, load_optimized_blas

COURIER = "courier"
# Courier at another commit (`--baseline-tree DIR`), run and measured exactly like `courier`.
COURIER_BASELINE = "courier-baseline"
MLX_LM_4BIT = "mlx-lm-4bit"
MLX_LM_F32 = "mlx-lm-f32"
MLX_LM_F32_KERNELS = "mlx-lm-f32-kernels"
SERVER_NAMES = (COURIER, COURIER_BASELINE, MLX_LM_4BIT, MLX_LM_F32, MLX_LM_F32_KERNELS)
F32_SERVERS = (MLX_LM_F32, MLX_LM_F32_KERNELS)
COURIER_MODEL_ID = "SmolLM2-135M-Instruct"
# mlx_lm.server maps this id to the model given by --model.
MLX_LM_MODEL_ID = "default_model"
OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
# The in-process reference's weights: as Courier serves them on this device (`auto`), or one of the two named.
FLOAT32 = "float32"
STORED = "stored"
WEIGHT_CHOICES = ("auto", FLOAT32, STORED)
WEIGHT_LABELS = {
    FLOAT32: "float32 (from the 4-bit conversion of the embedded GGUF)",
    STORED: "4-bit as stored (the conversion of the embedded GGUF)",
}

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0
READY_POLL_S = 0.5
QUIET_POLL_S = 30.0
RETRY_PAUSE_S = 5.0
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 900.0
LOG_TAIL_CHARS = 3000

# Targets at the comparison level (8 streams by default).
TARGET_SINGLE_STREAM_RATIO = 0.95
TARGET_VS_TUNED = 1.3
TARGET_VS_AS_SHIPPED = 5.0

WARMUP_PROMPT = "Say hello in one short sentence."
TOPICS = (
    "the ocean", "a lighthouse", "autumn leaves", "coffee", "a mountain village", "robots",
    "the moon", "baking bread", "a thunderstorm", "chess", "honey bees", "old libraries",
    "night trains", "volcanoes", "a lost key", "jazz", "winter mornings", "deserts",
    "gardening", "comets", "bicycles", "rivers", "owls", "street markets",
)  # fmt: skip
TASKS = (
    "Write a short poem about {}.",
    "Give three fun facts about {}.",
    "Describe {} in two sentences.",
    "Tell a very short story about {}.",
    "Explain why people like {}.",
    "Write a haiku about {}.",
)
ESSAY_PROMPT = "Write a detailed, multi-paragraph essay about the history of {}."


class BenchmarkError(RuntimeError):
    """A server did not start, answer or stream as expected; the message says how."""


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamResult:
    """One streaming chat completion, timed on `time.perf_counter()`."""

    prompt: str
    completion_tokens: int
    content_deltas: int
    sent: float
    first_token: float
    last_token: float
    done: float

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent

    @property
    def decode_tps(self) -> float:
        span = self.last_token - self.first_token
        return (self.completion_tokens - 1) / span if span > 0 else math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamRecord:
    """What the JSON report keeps of one stream."""

    completion_tokens: int
    content_deltas: int
    ttft_s: float
    decode_tps: float
    total_s: float

    @classmethod
    def of(cls, stream: StreamResult) -> StreamRecord:
        return cls(
            completion_tokens=stream.completion_tokens,
            content_deltas=stream.content_deltas,
            ttft_s=stream.ttft_s,
            decode_tps=stream.decode_tps,
            total_s=stream.done - stream.sent,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelResult:
    server: str
    clients: int
    completion_tokens: int
    wall_s: float
    aggregate_tps: float
    ttft_p50_s: float
    ttft_p95_s: float
    streams: list[StreamRecord]
    retried: bool = False  # the first attempt was refused a connection; these are the second one's figures


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleStreamResult:
    """Median over the single-stream prompts; `runs_tps` holds each one."""

    server: str
    decode_tps: float
    completion_tokens: list[int]
    runs_tps: list[float]
    # mlx-lm in process on the same prompts, each run just before the server's (median, and each run).
    paired_in_process_tps: float | None = None
    paired_runs_tps: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class InProcessResult:
    """mlx-lm `stream_generate` in this process, on float32 weights or as stored (`weights` says which).

    `generation_tps` is mlx-lm's own figure (tokens / time since the first token);
    `decode_tps` is the servers' formula, (tokens - 1) / (last - first token).
    """

    weights: str
    blas: dict[str, object]
    generation_tps: float
    decode_tps: float
    completion_tokens: list[int]
    runs_generation_tps: list[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerRun:
    name: str
    command: list[str]
    extra_env: dict[str, str]
    ready_s: float | None = None
    # The 1-minute load average when its measurement started, and how long it waited for a quiet machine.
    load_at_start: float | None = None
    waited_for_quiet_s: float = 0.0
    single_stream: SingleStreamResult | None = None
    levels: list[LevelResult] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    clients: int
    courier_vs_tuned: float | None
    courier_vs_as_shipped: float | None
    courier_ttft_p95_below_both: bool | None
    courier_vs_equal_kernels: float | None = None  # against mlx-lm-f32-kernels, for the record


@dataclass(frozen=True, slots=True, kw_only=True)
class Ratio:
    """One figure of `courier` over the same figure of `courier-baseline`."""

    courier: float
    baseline: float
    ratio: float

    @classmethod
    def of(cls, courier: float, baseline: float) -> Ratio:
        return cls(courier=courier, baseline=baseline, ratio=courier / baseline if baseline else math.nan)


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineLevel:
    """courier / courier-baseline at one client count: tok/s above 1 and TTFT below 1 favour courier."""

    clients: int
    aggregate_tps: Ratio
    ttft_p95_s: Ratio


@dataclass(frozen=True, slots=True, kw_only=True)
class BaselineComparison:
    """courier against courier-baseline, the same server at the commit checked out in `tree`."""

    tree: str
    commit: str | None
    single_stream_tps: Ratio | None
    levels: list[BaselineLevel]


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    in_process: InProcessResult | None
    servers: list[ServerRun]
    comparison: Comparison
    baseline: BaselineComparison | None = None


# ---------------------------------------------------------------- prompts


class PromptPool:
    """Distinct short prompts, handed out in the same order for every server."""

    def __init__(self) -> None:
        combos = itertools.product(TOPICS, TASKS)
        self._prompts: Iterator[str] = (task.format(topic) for topic, task in combos)
        self._issued = 0

    def take(self, count: int) -> list[str]:
        taken: list[str] = []
        for _ in range(count):
            prompt = next(self._prompts, None)
            self._issued += 1
            taken.append(prompt if prompt is not None else f"Write a short note numbered {self._issued}.")
        return taken


def essay_prompts(count: int) -> list[str]:
    """Long-answer prompts for single-stream decode, one per repeat."""
    return [ESSAY_PROMPT.format(topic) for topic in itertools.islice(itertools.cycle(TOPICS), count)]


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


# ---------------------------------------------------------------- models and the in-process reference


def prepare_4bit_dir(cache_dir: Path) -> Path:
    from courier.model.gguf_convert import ensure_converted
    from courier.model.progress import Progress
    from courier.model.source import embedded_gguf_path

    return ensure_converted(embedded_gguf_path(), cache_dir, Progress(enabled=False))


def load_float32(dir4: Path) -> tuple[Any, Any]:
    """The model and tokenizer exactly as Courier's loader prepares them on CPU."""
    import mlx.core as mx
    from mlx_lm import load

    from courier.model.weight_format import to_dense_dtype

    model, tokenizer = load(str(dir4))
    return to_dense_dtype(model, mx.float32), tokenizer


def reference_weights(choice: str) -> str:
    """`float32` or `stored`; `auto` is what Courier's loader serves on the device MLX runs on."""
    if choice != "auto":
        return choice
    from courier.model.device import active_device, serving_dtype

    return STORED if serving_dtype("auto", active_device()) is None else FLOAT32


def load_reference(dir4: Path, weights: str) -> tuple[Any, Any]:
    """The model and tokenizer for mlx-lm in process: dequantized to float32, or as stored."""
    if weights == FLOAT32:
        return load_float32(dir4)
    from mlx_lm import load

    model, tokenizer = load(str(dir4))
    return model, tokenizer


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default="auto",
        help="weights of mlx-lm in process: float32 (dequantized, as Courier serves them on a CPU), stored (as on "
        "a GPU) or auto (as Courier serves them on this device)",
    )


def mlx_device() -> str:
    """MLX's default device and the backend wheel behind it, e.g. "gpu (mlx-cuda-12)"."""
    import mlx.core as mx

    from courier.platform.mlx_backend import installed_backend

    return f"{mx.default_device().type.name} ({installed_backend() or 'mlx'})"


def save_float32_dir(model: Any, dir4: Path, target: Path) -> Path:
    """An MLX model directory holding the float32 weights, for mlx_lm.server."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    config = json.loads((dir4 / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(dir4 / name, target / name)
    weights: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    return target


class InProcessReference:
    """mlx-lm's `stream_generate` in this process, on the weights it is given."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from mlx_lm import stream_generate

        self._model = model
        self._tokenizer = tokenizer
        self._stream_generate = stream_generate
        self.run(WARMUP_PROMPT, 8)

    def run(self, prompt: str, max_tokens: int) -> tuple[float, float, int]:
        """One generation: mlx-lm's generation_tps, the HTTP formula's decode rate, and the tokens."""
        tokens: list[int] = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        stamps: list[float] = []
        last: Any = None
        for response in self._stream_generate(self._model, self._tokenizer, tokens, max_tokens=max_tokens):
            stamps.append(time.perf_counter())
            last = response
        if last is None or len(stamps) < 2:
            raise BenchmarkError(f"in-process generation produced fewer than 2 tokens for {prompt!r}")
        decode_tps = (last.generation_tokens - 1) / (stamps[-1] - stamps[0])
        return float(last.generation_tps), decode_tps, int(last.generation_tokens)


def measure_in_process(
    reference: InProcessReference, prompts: Sequence[str], max_tokens: int, blas: BlasReport, weights: str
) -> InProcessResult:
    runs = [reference.run(prompt, max_tokens) for prompt in prompts]
    generation_tps = [run[0] for run in runs]
    return InProcessResult(
        weights=WEIGHT_LABELS[weights],
        blas=blas.as_dict(),
        generation_tps=statistics.median(generation_tps),
        decode_tps=statistics.median(run[1] for run in runs),
        completion_tokens=[run[2] for run in runs],
        runs_generation_tps=generation_tps,
    )


def release_mlx_memory() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


# ---------------------------------------------------------------- server processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def venv_script(name: str) -> str:
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise BenchmarkError(f"cannot find the {name!r} command next to {sys.executable} or on PATH")
    return found


def is_courier(name: str) -> bool:
    """Courier at this commit or at the baseline's: both are started, polled and measured alike."""
    return name in (COURIER, COURIER_BASELINE)


def baseline_python() -> list[str]:
    """Our Python (the same virtualenv) with -P: the working directory, which holds this tree's `courier`, does not
    come first on sys.path, so the baseline tree on PYTHONPATH (see `courier_env`) is where `courier` comes from."""
    return [sys.executable, "-P"]


def courier_launcher(name: str) -> list[str]:
    """What runs `courier`: this tree's script, or for courier-baseline the baseline tree's package."""
    if name == COURIER_BASELINE:
        return [*baseline_python(), "-m", "courier"]
    return [venv_script("courier")]


def courier_env(name: str, baseline_tree: Path | None) -> dict[str, str]:
    if name != COURIER_BASELINE:
        return {}
    if baseline_tree is None:
        raise BenchmarkError(f"{COURIER_BASELINE} needs --baseline-tree DIR")
    return {"PYTHONPATH": str(baseline_tree)}


def check_baseline_tree(baseline_tree: Path) -> None:
    """Fail unless courier-baseline, started as it will be, imports the `courier` package of `baseline_tree`."""
    import courier  # this tree's, as the bench imports it

    expected = (baseline_tree / "courier" / "__init__.py").resolve()
    if expected == Path(courier.__file__).resolve():
        raise BenchmarkError(f"--baseline-tree {baseline_tree} is this checkout; give another commit's tree")
    env = server_env(courier_env(COURIER_BASELINE, baseline_tree))
    probe = [*baseline_python(), "-c", "import courier; print(courier.__file__)"]
    try:
        found = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        raise BenchmarkError(f"cannot run {shlex.join(probe)}: {error}") from error
    if found.returncode != 0:
        raise BenchmarkError(
            f"cannot import courier from --baseline-tree {baseline_tree}:\n{found.stderr[-LOG_TAIL_CHARS:]}"
        )
    imported = Path(found.stdout.strip()).resolve()
    if imported != expected:
        raise BenchmarkError(f"{COURIER_BASELINE} would import courier from {imported}, not from {expected}")


def tree_commit(tree: Path) -> str | None:
    """The commit checked out in `tree` (None when git cannot tell)."""
    try:
        found = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def server_command(name: str, port: int, cache_dir: Path, model_dir: Path | None, max_clients: int) -> list[str]:
    if is_courier(name):
        return [*courier_launcher(name), "serve", "--port", str(port), "--cache-dir", str(cache_dir)]
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    if name in F32_SERVERS:
        command += ["--decode-concurrency", str(max_clients), "--prompt-concurrency", str(max_clients)]
        command += ["--log-level", "WARNING"]
    return command


def server_extra_env(
    name: str, openblas: str, cache_dir: Path, kernels: str | None = None, *, baseline_tree: Path | None = None
) -> dict[str, str]:
    """Environment a server gets on top of ours (which loses LD_PRELOAD and OPENBLAS_CORETYPE).

    Courier chooses its BLAS kernels itself; `mlx-lm-f32-kernels` gets `kernels`, the ones it chose.
    courier-baseline gets `PYTHONPATH=baseline_tree`.

    mlx_lm.server's `/v1/models` lists the Hugging Face hub cache and fails mid-answer when
    there is none, so it gets an empty one of its own; nothing is loaded from it.
    """
    if is_courier(name):
        return courier_env(name, baseline_tree)
    hub_cache = cache_dir / "bench-hf-hub"
    hub_cache.mkdir(parents=True, exist_ok=True)
    extra = {"HF_HUB_CACHE": str(hub_cache)}
    if name in F32_SERVERS:
        extra["LD_PRELOAD"] = openblas
    if name == MLX_LM_F32_KERNELS and kernels:
        extra["OPENBLAS_CORETYPE"] = kernels
    return extra


def server_env(extra: dict[str, str]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in {"LD_PRELOAD", "OPENBLAS_CORETYPE"}}
    env.update(extra)
    return env


def ready_path(name: str) -> str:
    return "/health" if is_courier(name) else "/v1/models"


def model_id(name: str) -> str:
    return COURIER_MODEL_ID if is_courier(name) else MLX_LM_MODEL_ID


def log_tail(log_path: Path) -> str:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return text[-LOG_TAIL_CHARS:]


@contextmanager
def running_server(command: list[str], env: dict[str, str], log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start a server process, logging to `log_path`; stop it (SIGTERM, then SIGKILL) on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield process
        finally:
            stop_server(process)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until_ready(process: subprocess.Popen[bytes], url: str, log_path: Path) -> float:
    """Poll `url` until it answers 200; return the seconds it took."""
    started = time.monotonic()
    deadline = started + READY_TIMEOUT_S
    last_problem = "no answer yet"
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise BenchmarkError(
                    f"server exited with {process.returncode} before it was ready:\n{log_tail(log_path)}"
                )
            try:
                response = http.get(url)
                if response.status_code == 200:
                    return time.monotonic() - started
                last_problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as error:
                last_problem = f"{type(error).__name__}: {error}"
            time.sleep(READY_POLL_S)
    raise BenchmarkError(f"{url} not ready after {READY_TIMEOUT_S:.0f} s ({last_problem}):\n{log_tail(log_path)}")


# ---------------------------------------------------------------- clients


def make_client(port: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://{HOST}:{port}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


async def stream_completion(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> StreamResult:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    sent = time.perf_counter()
    first_token: float | None = None
    last_token = sent
    deltas = 0
    usage_tokens: int | None = None
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
        if any(choice.delta.content for choice in chunk.choices):
            last_token = time.perf_counter()
            first_token = last_token if first_token is None else first_token
            deltas += 1
    done = time.perf_counter()
    if first_token is None:
        raise BenchmarkError(f"the stream for {prompt!r} carried no content")
    return StreamResult(
        prompt=prompt,
        completion_tokens=usage_tokens if usage_tokens is not None else deltas,
        content_deltas=deltas,
        sent=sent,
        first_token=first_token,
        last_token=last_token,
        done=done,
    )


async def measure_single_stream(
    client: openai.AsyncOpenAI,
    server: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    *,
    reference: InProcessReference | None,
) -> SingleStreamResult:
    """Each prompt in process (while the server idles), then over HTTP: the pair sees the same machine."""
    streams: list[StreamResult] = []
    paired: list[float] = []
    for prompt in prompts:
        if reference is not None:
            paired.append(reference.run(prompt, max_tokens)[0])
        streams.append(await stream_completion(client, model, prompt, max_tokens))
    runs = [stream.decode_tps for stream in streams]
    return SingleStreamResult(
        server=server,
        decode_tps=statistics.median(runs),
        completion_tokens=[stream.completion_tokens for stream in streams],
        runs_tps=runs,
        paired_in_process_tps=statistics.median(paired) if paired else None,
        paired_runs_tps=paired,
    )


async def measure_level(
    client: openai.AsyncOpenAI, server: str, model: str, prompts: Sequence[str], max_tokens: int
) -> LevelResult:
    streams = await asyncio.gather(*(stream_completion(client, model, prompt, max_tokens) for prompt in prompts))
    wall_s = max(stream.done for stream in streams) - min(stream.sent for stream in streams)
    tokens = sum(stream.completion_tokens for stream in streams)
    ttfts = [stream.ttft_s for stream in streams]
    return LevelResult(
        server=server,
        clients=len(prompts),
        completion_tokens=tokens,
        wall_s=wall_s,
        aggregate_tps=tokens / wall_s,
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p95_s=percentile(ttfts, 0.95),
        streams=[StreamRecord.of(stream) for stream in streams],
    )


@dataclass(slots=True)
class Measured:
    """What a server run measured so far: kept when a later part fails."""

    single: SingleStreamResult | None = None
    levels: list[LevelResult] = field(default_factory=list)


async def measure_server(
    server: str, port: int, single_prompts: Sequence[str], args: argparse.Namespace, measured: Measured
) -> None:
    model = model_id(server)
    pool = PromptPool()
    async with make_client(port) as client:
        await stream_completion(client, model, WARMUP_PROMPT, args.max_tokens)
        progress(f"{server}: single stream, {len(single_prompts)} x {args.single_tokens} tokens")
        measured.single = await measure_single_stream(
            client, server, model, single_prompts, args.single_tokens, reference=args.reference
        )
        for clients in args.concurrency:
            progress(f"{server}: {clients} concurrent streams x {args.max_tokens} tokens")
            try:
                level = await measure_level(client, server, model, pool.take(clients), args.max_tokens)
            except openai.APIConnectionError as error:
                # mlx_lm.server's HTTP server has a small listen backlog: a burst can be refused a connection.
                # Once more, after a pause, with fresh prompts (the refused ones may be partly cached by now).
                progress(f"{server}: {clients} streams: {type(error).__name__}: {error}; retrying once")
                await asyncio.sleep(RETRY_PAUSE_S)
                level = await measure_level(client, server, model, pool.take(clients), args.max_tokens)
                level = replace(level, retried=True)
            measured.levels.append(level)


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


def run_server(
    server: str, model_dir: Path | None, cache_dir: Path, single_prompts: Sequence[str], args: argparse.Namespace
) -> ServerRun:
    load, waited = wait_for_quiet(args.quiet_load, args.quiet_timeout)
    measured = Measured()
    ready_s: float | None = None
    error_text: str | None = None
    port = free_port()
    command = server_command(server, port, cache_dir, model_dir, max(args.concurrency))
    extra_env = server_extra_env(server, args.openblas, cache_dir, args.kernels, baseline_tree=args.baseline_tree)
    log_path = cache_dir / "bench-logs" / f"{server}.log"
    env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
    progress(f"{server}: starting {env_text + ' ' if env_text else ''}{' '.join(command)} (log: {log_path})")
    try:
        with running_server(command, server_env(extra_env), log_path) as process:
            ready_s = wait_until_ready(process, f"http://{HOST}:{port}{ready_path(server)}", log_path)
            progress(f"{server}: ready after {ready_s:.1f} s")
            asyncio.run(measure_server(server, port, single_prompts, args, measured))
    except (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError) as error:
        error_text = f"{type(error).__name__}: {error}"
        progress(f"{server}: FAILED: {error_text}")
    return ServerRun(
        name=server,
        command=command,
        extra_env=extra_env,
        ready_s=ready_s,
        load_at_start=load,
        waited_for_quiet_s=waited,
        single_stream=measured.single,
        levels=measured.levels,
        error=error_text,
    )


# ---------------------------------------------------------------- report


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def environment(blas: BlasReport) -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "mlx": metadata.version("mlx"),
        "mlx-lm": metadata.version("mlx-lm"),
        "courier": metadata.version("courier"),
        "openai": metadata.version("openai"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "mlx_device": mlx_device(),
        "bench_process_blas": blas.as_dict(),
    }


def level_at(runs: Sequence[ServerRun], server: str, clients: int) -> LevelResult | None:
    for run in runs:
        if run.name == server:
            return next((level for level in run.levels if level.clients == clients), None)
    return None


def compare(runs: Sequence[ServerRun], clients: int) -> Comparison:
    courier = level_at(runs, COURIER, clients)
    tuned = level_at(runs, MLX_LM_F32, clients)
    shipped = level_at(runs, MLX_LM_4BIT, clients)
    equal_kernels = level_at(runs, MLX_LM_F32_KERNELS, clients)
    below_both = None
    if courier is not None and tuned is not None and shipped is not None:
        below_both = courier.ttft_p95_s < min(tuned.ttft_p95_s, shipped.ttft_p95_s)
    return Comparison(
        clients=clients,
        courier_vs_tuned=courier.aggregate_tps / tuned.aggregate_tps if courier and tuned else None,
        courier_vs_as_shipped=courier.aggregate_tps / shipped.aggregate_tps if courier and shipped else None,
        courier_ttft_p95_below_both=below_both,
        courier_vs_equal_kernels=(
            courier.aggregate_tps / equal_kernels.aggregate_tps if courier and equal_kernels else None
        ),
    )


def compare_baseline(runs: Sequence[ServerRun], tree: Path, concurrency: Sequence[int]) -> BaselineComparison:
    ours = next((run for run in runs if run.name == COURIER), None)
    theirs = next((run for run in runs if run.name == COURIER_BASELINE), None)
    single = None
    if ours and theirs and ours.single_stream and theirs.single_stream:
        single = Ratio.of(ours.single_stream.decode_tps, theirs.single_stream.decode_tps)
    levels: list[BaselineLevel] = []
    for clients in concurrency:
        level, base = level_at(runs, COURIER, clients), level_at(runs, COURIER_BASELINE, clients)
        if level is not None and base is not None:
            levels.append(
                BaselineLevel(
                    clients=clients,
                    aggregate_tps=Ratio.of(level.aggregate_tps, base.aggregate_tps),
                    ttft_p95_s=Ratio.of(level.ttft_p95_s, base.ttft_p95_s),
                )
            )
    return BaselineComparison(tree=str(tree), commit=tree_commit(tree), single_stream_tps=single, levels=levels)


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}x ({'meets' if value >= target else 'misses'} target >= {target}x)"


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier throughput benchmark\n")
    print(f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, courier {env['courier']}")
    print(f"- machine: {env['platform']} ({env['machine']}, {env['processor']}), {env['cpu_count']} CPUs")
    print(f"- MLX device: {env['mlx_device']}")
    print(f"- settings: {report.settings}\n")
    print_commands(report.servers)
    print_single_stream(report)
    print_sweep(report.servers)
    print_comparison(report.comparison)
    if report.baseline is not None:
        print_baseline(report.baseline)


def server_line(name: str, command: Sequence[str], extra_env: dict[str, str], status: str) -> str:
    """A server as a Markdown list item: its name, the environment it got on top of ours and its command, and
    `status` (how its start went)."""
    env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
    return f"- `{name}`: `{(env_text + ' ') if env_text else ''}{' '.join(command)}` ({status})"


def print_commands(runs: Sequence[ServerRun]) -> None:
    print("### Servers\n")
    for run in runs:
        env_text = " ".join(f"{key}={value}" for key, value in run.extra_env.items())
        status = f"ready in {run.ready_s:.1f} s" if run.ready_s is not None else "not ready"
        if run.error is not None:
            status += f"; FAILED after {len(run.levels)} levels: {run.error}"
        if run.load_at_start is not None:
            status += f", load {run.load_at_start:.2f} at start"
        print(f"- `{run.name}`: `{(env_text + ' ') if env_text else ''}{' '.join(run.command)}` ({status})")
    print()


def print_single_stream(report: Report) -> None:
    reference = report.in_process
    print("### Single-stream decode\n")
    if reference is not None:
        print(
            f"In-process mlx-lm `stream_generate`, {reference.weights}, BLAS {reference.blas['library']}: "
            f"generation_tps {reference.generation_tps:.1f} tok/s (same formula as HTTP: {reference.decode_tps:.1f}), "
            f"tokens {reference.completion_tokens}\n"
        )
    print("The ratio is against in-process runs of the same prompts, each just before the server's (paired).\n")
    print("| server | HTTP decode tok/s | tokens | paired in-process tok/s | HTTP / in-process |")
    print("|---|---|---|---|---|")
    for run in report.servers:
        single = run.single_stream
        if single is None:
            continue
        in_tps = single.paired_in_process_tps or (reference.generation_tps if reference else math.nan)
        ratio = single.decode_tps / in_tps
        target = f" (target >= {TARGET_SINGLE_STREAM_RATIO})" if is_courier(run.name) else ""
        tokens = single.completion_tokens
        print(f"| {run.name} | {single.decode_tps:.1f} | {tokens} | {in_tps:.1f} | {ratio:.3f}{target} |")
    print()


def print_sweep(runs: Sequence[ServerRun]) -> None:
    print("### Concurrency sweep\n")
    print("| server | clients | aggregate tok/s | TTFT p50 s | TTFT p95 s | tokens | wall s |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        for level in run.levels:
            retried = " (retried)" if level.retried else ""
            print(
                f"| {run.name} | {level.clients}{retried} | {level.aggregate_tps:.1f} | {level.ttft_p50_s:.3f} "
                f"| {level.ttft_p95_s:.3f} | {level.completion_tokens} | {level.wall_s:.2f} |"
            )
    print()


def print_comparison(comparison: Comparison) -> None:
    below = comparison.courier_ttft_p95_below_both
    vs_tuned = verdict(comparison.courier_vs_tuned, TARGET_VS_TUNED)
    vs_shipped = verdict(comparison.courier_vs_as_shipped, TARGET_VS_AS_SHIPPED)
    print(f"### Targets at {comparison.clients} streams\n")
    print(f"- Courier / tuned mlx_lm.server (float32, OpenBLAS): {vs_tuned}")
    print(f"- Courier / as-shipped mlx_lm.server (4-bit): {vs_shipped}")
    print(f"- Courier TTFT p95 below both: {'n/a' if below is None else ('yes' if below else 'no')}")
    if comparison.courier_vs_equal_kernels is not None:
        print(f"- Courier / mlx_lm.server on the same BLAS kernels: {comparison.courier_vs_equal_kernels:.2f}x")


def ratio_text(ratio: Ratio, digits: int, unit: str = "") -> str:
    return f"{ratio.courier:.{digits}f} / {ratio.baseline:.{digits}f}{unit} = {ratio.ratio:.3f}x"


def print_baseline(baseline: BaselineComparison) -> None:
    commit = f" (commit {baseline.commit})" if baseline.commit else ""
    print("\n### courier / courier-baseline\n")
    print(
        f"`{COURIER_BASELINE}` is Courier from `{baseline.tree}`{commit}, run and measured like `{COURIER}`. "
        "Above 1 favours courier for tok/s, below 1 for TTFT.\n"
    )
    if baseline.single_stream_tps is not None:
        print(f"- courier / courier-baseline, single-stream decode tok/s: {ratio_text(baseline.single_stream_tps, 1)}")
    for level in baseline.levels:
        print(
            f"- courier / courier-baseline at {level.clients} streams: aggregate tok/s "
            f"{ratio_text(level.aggregate_tps, 1)}, TTFT p95 {ratio_text(level.ttft_p95_s, 3, ' s')}"
        )
    if not baseline.levels:
        print("- courier / courier-baseline: no ratio (one of them measured no level)")


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def positive_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def server_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in SERVER_NAMES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"servers must be among {', '.join(SERVER_NAMES)}, got {text!r}")
    return list(dict.fromkeys(names))


def in_run_order(servers: Sequence[str]) -> list[str]:
    """`servers` as given, but the two Courier servers next to each other, in the order given (list
    courier-baseline first to run it first), so drift on a noisy machine hits both alike."""
    if COURIER not in servers or COURIER_BASELINE not in servers:
        return list(servers)
    first, second = sorted((COURIER, COURIER_BASELINE), key=list(servers).index)
    ordered = [name for name in servers if name != second]
    ordered.insert(ordered.index(first) + 1, second)
    return ordered


def choose_servers(
    parser: argparse.ArgumentParser,
    flag: str,
    chosen: Sequence[str] | None,
    default: Sequence[str],
    baseline: Path | None,
) -> list[str]:
    """The servers `flag` chose, or `default` plus courier-baseline when there is a baseline tree, in run order."""
    if chosen is None:
        chosen = [*default, COURIER_BASELINE] if baseline is not None else default
    if COURIER_BASELINE in chosen and baseline is None:
        parser.error(f"{flag} {COURIER_BASELINE} needs --baseline-tree DIR")
    return in_run_order(chosen)


def add_baseline_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline-tree",
        type=lambda text: Path(text).resolve(),
        default=None,
        metavar="DIR",
        help=f"a checkout of another commit: adds {COURIER_BASELINE}, Courier imported from DIR, beside {COURIER}",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 4, 8, 16], help="client counts (1,4,8,16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="completion tokens per sweep request (32)")
    parser.add_argument(
        "--servers",
        type=server_list,
        default=None,
        help=f"{','.join(SERVER_NAMES)} (all; {COURIER_BASELINE} only with --baseline-tree)",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    parser.add_argument("--single-tokens", type=int, default=128, help="max tokens per single-stream request (128)")
    parser.add_argument("--single-repeats", type=int, default=3, help="single-stream requests per server (3)")
    parser.add_argument("--compare-at", type=int, default=8, help="client count the targets are checked at (8)")
    parser.add_argument("--quiet-load", type=float, default=None, help="wait for a 1-minute load below this")
    parser.add_argument("--quiet-timeout", type=float, default=900.0, help="longest wait for a quiet machine (900 s)")
    parser.add_argument("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for {MLX_LM_F32} ({OPENBLAS_PATH})")
    add_baseline_argument(parser)
    add_weights_argument(parser)
    args = parser.parse_args(argv)
    default = [name for name in SERVER_NAMES if name != COURIER_BASELINE]
    args.servers = choose_servers(parser, "--servers", args.servers, default, args.baseline_tree)
    return args


@contextmanager
def cache_directory(requested: Path | None) -> Iterator[Path]:
    if requested is not None:
        requested.mkdir(parents=True, exist_ok=True)
        yield requested.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as temporary:
        yield Path(temporary)


def prepare_reference(
    cache_dir: Path, single_prompts: Sequence[str], args: argparse.Namespace, blas: BlasReport
) -> tuple[Path, Path | None, InProcessReference, InProcessResult]:
    """Convert the GGUF, write the float32 directory if needed, and measure mlx-lm in process (kept loaded, so
    each server's single-stream runs are paired with in-process runs)."""
    progress("converting the embedded GGUF to a 4-bit MLX directory")
    dir4 = prepare_4bit_dir(cache_dir)
    weights = reference_weights(args.weights)
    progress(f"4-bit directory: {dir4}; loading it for mlx-lm in process: {WEIGHT_LABELS[weights]}")
    model, tokenizer = load_reference(dir4, weights)
    dir_f32 = None
    if any(server in args.servers for server in F32_SERVERS):
        dense = model if weights == FLOAT32 else load_float32(dir4)[0]
        dir_f32 = save_float32_dir(dense, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
        progress(f"float32 directory: {dir_f32}")
    progress(f"in-process mlx-lm: {len(single_prompts)} x {args.single_tokens} tokens")
    reference = InProcessReference(model, tokenizer)
    measured = measure_in_process(reference, single_prompts, args.single_tokens, blas, weights)
    return dir4, dir_f32, reference, measured


def baseline_ready(baseline_tree: Path | None, servers: Sequence[str]) -> bool:
    """Check, before anything is measured, that courier-baseline (if it runs) will import the baseline tree's code."""
    if baseline_tree is None or COURIER_BASELINE not in servers:
        return True
    try:
        check_baseline_tree(baseline_tree)
    except BenchmarkError as error:
        progress(f"{COURIER_BASELINE}: {error}")
        return False
    progress(f"{COURIER_BASELINE}: courier from {baseline_tree} (commit {tree_commit(baseline_tree) or 'unknown'})")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if any(server in args.servers for server in F32_SERVERS) and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or leave out {MLX_LM_F32}")
        return 2
    if not baseline_ready(args.baseline_tree, args.servers):
        return 2
    # Before anything imports MLX, so the in-process reference runs on OpenBLAS, with the kernels Courier picks.
    os.environ.pop("OPENBLAS_CORETYPE", None)
    blas = load_optimized_blas()
    args.kernels = blas.kernels
    single_prompts = essay_prompts(args.single_repeats)
    runs: list[ServerRun] = []
    with cache_directory(args.cache_dir) as cache_dir:
        wait_for_quiet(args.quiet_load, args.quiet_timeout)
        dir4, dir_f32, args.reference, reference = prepare_reference(cache_dir, single_prompts, args, blas)
        model_dirs = {
            COURIER: None,
            COURIER_BASELINE: None,
            MLX_LM_4BIT: dir4,
            MLX_LM_F32: dir_f32,
            MLX_LM_F32_KERNELS: dir_f32,
        }
        for server in args.servers:
            runs.append(run_server(server, model_dirs[server], cache_dir, single_prompts, args))
    settings = {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "single_tokens": args.single_tokens,
        "single_repeats": args.single_repeats,
        "servers": args.servers,
        "quiet_load": args.quiet_load,
        "baseline_tree": str(args.baseline_tree) if args.baseline_tree else None,
        "weights": reference.weights,
        "openblas_kernels": blas.kernels,
        "openblas_kernel_choice": blas.kernel_choice,
    }
    baseline = None
    if COURIER_BASELINE in args.servers:
        baseline = compare_baseline(runs, args.baseline_tree, args.concurrency)
    report = Report(
        environment=environment(blas),
        settings=settings,
        in_process=reference,
        servers=runs,
        comparison=compare(runs, args.compare_at),
        baseline=baseline,
    )
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
