"""The models a bench serves or runs in process: the embedded SmolLM2 (its 4-bit conversion, dequantized to
float32), mlx-lm's `stream_generate` on it, and the tiny random-weight models.

MLX is imported late everywhere here: a bench loads its BLAS first.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import support
from bench.harness.report import progress
from bench.harness.servers import COURIER_MODEL_ID, BenchmarkError, Launcher
from courier.platform.blas import BlasReport, load_optimized_blas

FLOAT32 = "float32"
STORED = "stored"
WEIGHT_CHOICES = ("auto", FLOAT32, STORED)
WEIGHT_LABELS = {
    FLOAT32: "float32 (from the 4-bit conversion of the embedded GGUF)",
    STORED: "4-bit as stored (the conversion of the embedded GGUF)",
}
WARMUP_PROMPT = "Say hello in one short sentence."
TINY_MODELS = ("llama", "qwen3_next")
# The same with 64-dimension attention heads (the tiny ones' 16 allow no quantized prompt-cache snapshots).
WIDE_TINY_MODELS = ("llama-wide", "qwen3_next-wide")


@contextmanager
def cache_directory(requested: Path | None) -> Iterator[Path]:
    """`requested` (kept), or a temporary directory removed afterwards."""
    if requested is not None:
        requested.mkdir(parents=True, exist_ok=True)
        yield requested.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="courier-bench-") as temporary:
        yield Path(temporary)


@contextmanager
def launching(bench: str, requested: Path | None, **options: Any) -> Iterator[Launcher]:
    """A Launcher for `bench` on the cache directory (`requested`, or a temporary one), its logs in bench-logs/."""
    with cache_directory(requested) as cache_dir:
        yield Launcher(bench=bench, cache_dir=cache_dir, log_dir=cache_dir / "bench-logs", **options)


def reference_blas() -> BlasReport:
    """Load the BLAS before anything imports MLX, so mlx-lm in process runs on OpenBLAS with the kernels Courier
    picks (the environment's OPENBLAS_CORETYPE dropped)."""
    os.environ.pop("OPENBLAS_CORETYPE", None)
    return load_optimized_blas()


def prepare_4bit_dir(cache_dir: Path) -> Path:
    """The embedded GGUF converted to a 4-bit MLX directory (once per cache directory)."""
    from courier.model.gguf_convert import ensure_converted
    from courier.model.progress import Progress
    from courier.model.source import embedded_gguf_path

    return ensure_converted(embedded_gguf_path(), cache_dir, Progress(enabled=False))


def load_float32(dir4: Path) -> tuple[Any, Any]:
    """The model and tokenizer exactly as Courier's loader prepares them on a CPU."""
    import mlx.core as mx
    from mlx_lm import load

    from courier.model.weight_format import to_dense_dtype

    model, tokenizer = load(str(dir4))
    return to_dense_dtype(model, mx.float32), tokenizer


def float32_dir(dir4: Path, cache_dir: Path, model: Any = None) -> Path:
    """An MLX model directory of the float32 weights, for mlx_lm.server (from `model`, or loaded and released)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    dense = model if model is not None else load_float32(dir4)[0]
    target = cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    config = json.loads((dir4 / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(dir4 / name, target / name)
    weights: dict[str, mx.array] = dict(tree_flatten(dense.parameters()))
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    if model is None:
        del dense, weights
        release_mlx_memory()
    return target


def reference_weights(choice: str) -> str:
    """`float32` or `stored`; `auto` is what Courier's loader serves on the device MLX runs on."""
    if choice != "auto":
        return choice
    from courier.model.device import active_device, serving_dtype

    return STORED if serving_dtype("auto", active_device()) is None else FLOAT32


@dataclass(frozen=True, slots=True, kw_only=True)
class Generated:
    """One `stream_generate` run: mlx-lm's own generation_tps (tokens / time since the first token), the servers'
    decode formula (tokens - 1) / (last - first token), and the tokens."""

    generation_tps: float
    decode_tps: float
    completion_tokens: int


class InProcessReference:
    """mlx-lm's `stream_generate` in this process, on the weights it is given (warmed up once)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from mlx_lm import stream_generate

        self._model = model
        self._tokenizer = tokenizer
        self._stream_generate = stream_generate
        self.run(WARMUP_PROMPT, 8)

    def run(self, prompt: str, max_tokens: int) -> Generated:
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
        return Generated(
            generation_tps=float(last.generation_tps), decode_tps=decode_tps, completion_tokens=last.generation_tokens
        )

    def median(self, prompts: Sequence[str], max_tokens: int) -> tuple[list[Generated], float]:
        """Each prompt once: the runs and their median generation_tps."""
        runs = [self.run(prompt, max_tokens) for prompt in prompts]
        return runs, statistics.median(run.generation_tps for run in runs)


def load_reference(
    dir4: Path, choice: str, cache_dir: Path, *, float32_needed: bool
) -> tuple[InProcessReference, str, Path | None]:
    """mlx-lm in process on the weights `choice` names (see `reference_weights`), warmed up; those weights' label;
    and, when `float32_needed`, the float32 directory for mlx_lm.server (written from the same weights if float32)."""
    from mlx_lm import load

    weights = reference_weights(choice)
    progress(f"loading {dir4} for mlx-lm in process: {WEIGHT_LABELS[weights]}")
    model, tokenizer = load_float32(dir4) if weights == FLOAT32 else load(str(dir4))
    dir_f32 = None
    if float32_needed:
        dir_f32 = float32_dir(dir4, cache_dir, model if weights == FLOAT32 else None)
        progress(f"float32 directory: {dir_f32}")
    return InProcessReference(model, tokenizer), WEIGHT_LABELS[weights], dir_f32


def release_mlx_memory() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def tiny_model(kind: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    """A tiny random-weight model (`llama` or `qwen3_next`) with the embedded SmolLM2's tokenizer, in the cache."""
    return support.build_tiny(kind, tokenizer_dir, cache_dir / "bench-models" / f"tiny-{kind}")


def tiny_vision_model(target: Path) -> Path | None:
    """The tiny SmolVLM, or None without mlx-vlm."""
    return support.build_tiny_vision(target)


def load_served_model(cache_dir: Path) -> Any:
    """The embedded model exactly as `courier serve` loads it (on a CPU: float32 weights)."""
    from courier.model.loader import load_model
    from courier.model.progress import Progress
    from courier.model.source import resolve_model_source

    return load_model(
        resolve_model_source(None),
        served_model_name=None,
        cache_dir=cache_dir,
        weight_format="auto",
        first_pass=False,
        progress=Progress(enabled=False),
    )
