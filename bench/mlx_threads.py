"""One MLX thread for every model, or one each? Two models decoding at once, both ways (issue 33, item 4).

Each model decodes `--steps` tokens greedily after a short prompt, at batch size `--batch`. "shared": one thread
runs a step of one model, then one of the other, as Courier's one MLX thread serves two schedulers' steps in turn.
"threads": each model decodes on a thread of its own, on its own MLX stream. Reported: wall seconds, tokens per
second for both together, and each model's mean step time. Usage:

    python -m bench.mlx_threads [--model DIR] [--steps 64] [--batch 1] [--rounds 3] [--json PATH]

Without `--model` both models are the embedded SmolLM2 served as float32 (two copies of its weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from courier.platform.blas import load_optimized_blas

load_optimized_blas("auto")  # before MLX loads, as the server does

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from courier.model.gguf_convert import ensure_converted  # noqa: E402
from courier.model.progress import Progress  # noqa: E402
from courier.model.source import embedded_gguf_path  # noqa: E402
from courier.model.weight_format import to_dense_dtype  # noqa: E402

PROMPT = 32


def decode(model: Any, steps: int, batch: int, stream: Any = None) -> list[float]:
    """`steps` greedy decode steps after a prompt; each step's seconds."""
    with mx.stream(stream) if stream is not None else nullcontext():
        cache = make_prompt_cache(model)
        tokens = mx.zeros((batch, PROMPT), dtype=mx.int32)
        logits = model(tokens, cache=cache)
        mx.eval(logits)
        last = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            logits = model(last, cache=cache)
            last = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
            mx.eval(last)
            times.append(time.perf_counter() - started)
    return times


def shared(models: list[Any], steps: int, batch: int) -> tuple[float, list[list[float]]]:
    """One thread: a step of each model in turn (as the one MLX thread serves two schedulers)."""
    caches = [make_prompt_cache(model) for model in models]
    lasts = []
    for model, cache in zip(models, caches, strict=True):
        logits = model(mx.zeros((batch, PROMPT), dtype=mx.int32), cache=cache)
        lasts.append(mx.argmax(logits[:, -1, :], axis=-1)[:, None])
    mx.eval(lasts)
    times: list[list[float]] = [[] for _ in models]
    started = time.perf_counter()
    for _ in range(steps):
        for index, (model, cache) in enumerate(zip(models, caches, strict=True)):
            step_started = time.perf_counter()
            logits = model(lasts[index], cache=cache)
            lasts[index] = mx.argmax(logits[:, -1, :], axis=-1)[:, None]
            mx.eval(lasts[index])
            times[index].append(time.perf_counter() - step_started)
    return time.perf_counter() - started, times


def threaded(models: list[Any], steps: int, batch: int) -> tuple[float, list[list[float]]]:
    """A thread and a stream per model, decoding at once."""
    times: list[list[float]] = [[] for _ in models]

    def run(index: int) -> None:
        # MLX 0.32's streams belong to the thread that makes them.
        times[index] = decode(models[index], steps, batch, mx.new_stream(mx.default_device()))

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(models))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    arguments = parser.parse_args()
    directory = arguments.model or ensure_converted(
        embedded_gguf_path(), Path.home() / ".cache" / "courier", Progress(enabled=False)
    )
    models = []
    for _ in range(2):
        model = load(str(directory))[0]
        if mx.default_device().type == mx.DeviceType.cpu:
            model = to_dense_dtype(model, mx.float32)
        models.append(model)
    decode(models[0], 4, arguments.batch)  # warm up
    rows = []
    for mode, run in (("shared", shared), ("threads", threaded)):
        walls = []
        steps: list[float] = []
        for _ in range(arguments.rounds):
            wall, times = run(models, arguments.steps, arguments.batch)
            walls.append(wall)
            steps.extend(step for model_steps in times for step in model_steps)
        wall = statistics.median(walls)
        tokens = 2 * arguments.steps * arguments.batch
        step_ms = 1000 * statistics.mean(steps)
        rows.append({"mode": mode, "wall_s": wall, "tokens_per_s": tokens / wall, "step_ms": step_ms})
    print(f"device {mx.default_device()}, batch {arguments.batch}, {arguments.steps} steps x 2 models")
    print("| mode | wall s | tokens/s (both) | mean step ms |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['wall_s']:.2f} | {row['tokens_per_s']:.1f} | {row['step_ms']:.1f} |")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
