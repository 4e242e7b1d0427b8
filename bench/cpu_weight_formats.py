"""CPU throughput of the embedded SmolLM2 in each weight format and BLAS, each configuration loaded through
Courier's own loader in a process of its own, side by side with plain mlx-lm's (4-bit, bundled BLAS)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from bench.harness import cli
from bench.harness.report import table

CONFIGS: tuple[tuple[str, str, str, str, str], ...] = (
    # label, --weight-format, --blas, --blas-gemv, --cpu-attention
    ("peer: mlx-lm default (4-bit, bundled BLAS)", "native", "none", "off", "off"),
    ("4-bit, OpenBLAS", "native", "auto", "off", "off"),
    ("float32, bundled BLAS", "float32", "none", "off", "off"),
    ("float32, OpenBLAS, every product on sgemm (--no-blas-gemv)", "auto", "auto", "off", "off"),
    ("float32, OpenBLAS, gemv, MLX's softmax (--no-cpu-attention)", "auto", "auto", "on", "off"),
    ("Courier auto on CPU (float32, OpenBLAS, gemv, polynomial-exp attention)", "auto", "auto", "on", "on"),
)

WORKER = r"""
import json, sys, time
from pathlib import Path
from courier.platform.blas import load_optimized_blas
blas = load_optimized_blas(sys.argv[2], forward_gemv=sys.argv[7] == "on")
from courier.platform import cpu_attention
cpu_attention.install(sys.argv[8] == "on")
from mlx_lm import stream_generate
from courier.model.loader import load_model
from courier.model.source import resolve_model_source
from courier.model.progress import Progress
weight_format, cache_dir = sys.argv[1], Path(sys.argv[3])
prompt_tokens, decode_tokens, repeats = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
started = time.perf_counter()
loaded = load_model(resolve_model_source(None), served_model_name=None, cache_dir=cache_dir,
                    weight_format=weight_format, first_pass=True, progress=Progress(enabled=False))
load_s = time.perf_counter() - started
text = " ".join(["The quick brown fox jumps over the lazy dog."] * (prompt_tokens // 8))
tokens = loaded.tokenizer.encode(text)[:prompt_tokens]
runs = []
for _ in range(repeats):
    last = None
    for last in stream_generate(loaded.model, loaded.tokenizer, tokens, max_tokens=decode_tokens):
        pass
    runs.append({"prefill_tps": last.prompt_tps, "decode_tps": last.generation_tps, "peak_gb": last.peak_memory})
print(json.dumps({"blas": blas.library, "weights": loaded.info.weight_format, "load_s": load_s, "runs": runs}))
"""


@dataclass(frozen=True, slots=True)
class Result:
    label: str
    blas: str
    weights: str
    load_s: float
    prefill_tps: float
    decode_tps: float
    peak_gb: float


def measure(config: tuple[str, str, str, str, str], cache_dir: str, args: argparse.Namespace) -> Result:
    label, weight_format, blas, gemv, attention = config
    sizes = (args.prompt_tokens, args.decode_tokens, args.repeats)
    command = [sys.executable, "-c", WORKER, weight_format, blas, cache_dir, *map(str, sizes), gemv, attention]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    data = json.loads(output.strip().splitlines()[-1])
    runs = data["runs"]
    return Result(
        label=label,
        blas=data["blas"],
        weights=data["weights"],
        load_s=data["load_s"],
        prefill_tps=statistics.median(run["prefill_tps"] for run in runs),
        decode_tps=statistics.median(run["decode_tps"] for run in runs),
        peak_gb=max(run["peak_gb"] for run in runs),
    )


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens of the prompt prefilled (512)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded (64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration, the table shows medians (3)")
    parser.add_argument("--rows", default="", help="only these rows, by number from 1; the first is the peer (all)")
    args = parser.parse_args()
    rows = [CONFIGS[int(number) - 1] for number in args.rows.split(",")] if args.rows else list(CONFIGS)
    with tempfile.TemporaryDirectory() as cache_dir:
        results = [measure(config, cache_dir, args) for config in rows]
    peer = results[0]
    print(f"SmolLM2-135M, prompt {args.prompt_tokens} tokens, decode {args.decode_tokens}, median of {args.repeats}")
    print(f"peer (the first row): {peer.label}")
    table(
        "configuration | BLAS | weights | load s | prefill tok/s | decode tok/s | vs peer prefill | vs peer decode "
        "| peak GB",
        (
            f"{r.label} | {r.blas} | {r.weights} | {r.load_s:.1f} | {r.prefill_tps:.1f} | {r.decode_tps:.1f} "
            f"| {r.prefill_tps / peer.prefill_tps:.1f}x | {r.decode_tps / peer.decode_tps:.1f}x | {r.peak_gb:.2f}"
            for r in results
        ),
    )


if __name__ == "__main__":
    main()
