"""One MLX thread for every model, or one each? Two models decoding at once, both ways (issue 33, item 4): "shared"
runs a step of each model in turn on one thread; "threads" gives each model a thread and an MLX stream."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import cli
from bench.harness.report import table, write_json
from courier.platform.blas import load_optimized_blas

PROMPT = 32
Mode = Callable[[list[Any], int, int], tuple[float, list[list[float]]]]


class Decoder:
    """One model's greedy decode after a `PROMPT`-token prompt of zeros, a step at a time."""

    def __init__(self, model: Any, batch: int) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.mx, self.model, self.cache = mx, model, make_prompt_cache(model)
        self.last = self.next_token(model(mx.zeros((batch, PROMPT), dtype=mx.int32), cache=self.cache))
        self.times: list[float] = []

    def next_token(self, logits: Any) -> Any:
        last = self.mx.argmax(logits[:, -1, :], axis=-1)[:, None]
        self.mx.eval(last)
        return last

    def step(self) -> None:
        started = time.perf_counter()
        self.last = self.next_token(self.model(self.last, cache=self.cache))
        self.times.append(time.perf_counter() - started)


def shared(models: list[Any], steps: int, batch: int) -> tuple[float, list[list[float]]]:
    """One thread: a step of each model in turn (as the one MLX thread serves two schedulers)."""
    decoders = [Decoder(model, batch) for model in models]
    started = time.perf_counter()
    for _ in range(steps):
        for decoder in decoders:
            decoder.step()
    return time.perf_counter() - started, [decoder.times for decoder in decoders]


def threaded(models: list[Any], steps: int, batch: int) -> tuple[float, list[list[float]]]:
    """A thread and a stream per model, decoding at once."""
    import mlx.core as mx

    times: list[list[float]] = [[] for _ in models]

    def run(index: int) -> None:
        with mx.stream(mx.new_stream(mx.default_device())):  # MLX 0.32's streams belong to the thread making them
            decoder = Decoder(models[index], batch)
            for _ in range(steps):
                decoder.step()
        times[index] = decoder.times

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(models))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, times


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--model", type=Path, default=None, help="an MLX model directory (the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per model (64)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per model (1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per mode, the table shows medians (3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    load_optimized_blas("auto")  # before MLX loads, as the server does
    import mlx.core as mx
    from mlx_lm import load

    from bench.harness.models import prepare_4bit_dir
    from courier.model.weight_format import to_dense_dtype

    directory = args.model or prepare_4bit_dir(Path.home() / ".cache" / "courier")
    models = []
    for _ in range(2):
        model = load(str(directory))[0]
        models.append(to_dense_dtype(model, mx.float32) if mx.default_device().type == mx.DeviceType.cpu else model)
    warm_up = Decoder(models[0], args.batch)
    for _ in range(4):
        warm_up.step()
    rows = []
    modes: tuple[tuple[str, Mode], ...] = (("shared", shared), ("threads", threaded))
    for mode, run in modes:
        walls: list[float] = []
        steps: list[float] = []
        for _ in range(args.rounds):
            wall, times = run(models, args.steps, args.batch)
            walls.append(wall)
            steps.extend(step for model_steps in times for step in model_steps)
        wall = statistics.median(walls)
        tokens_per_s = 2 * args.steps * args.batch / wall
        rows.append(
            {"mode": mode, "wall_s": wall, "tokens_per_s": tokens_per_s, "step_ms": 1000 * statistics.mean(steps)}
        )
    print(f"device {mx.default_device()}, batch {args.batch}, {args.steps} steps x 2 models")
    table(
        "mode | wall s | tokens/s (both) | mean step ms",
        (f"{r['mode']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f}" for r in rows),
    )
    write_json(rows, args.json)


if __name__ == "__main__":
    main()
