"""What quantized prompt-cache snapshots (`--prompt-cache-bits`) do to the next tokens after a restore: log-probability
difference and top-1 agreement against full precision, in process (tests/support/kv_drift.py's measurement)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import cli, support
from bench.harness.models import cache_directory, load_float32, prepare_4bit_dir
from bench.harness.report import environment, head, progress, table, write_json
from courier.platform.blas import load_optimized_blas

MODELS = ("smollm2", "qwen3_next")
BITS = (8, 4)
SYSTEM = (
    "You are Quill, the customer assistant of Larkspur Books, an independent bookshop with two stores and an online "
    "catalogue. Answer in short, plain sentences and never invent facts about orders, prices or stock. The Market "
    "Street store opens Monday to Saturday from 9:00 to 19:00 and Sunday from 11:00 to 17:00; the Harbour Road store "
    "opens every day from 10:00 to 18:00. Orders placed online before 14:00 leave the same day; delivery takes two "
    "to four working days. Returns are accepted within 30 days with a receipt. Gift cards never expire."
)
CONVERSATIONS: tuple[tuple[str, ...], ...] = (
    ("When does the Harbour Road store open on Sundays?", "It opens at 10:00.", "And can I return a gift?"),
    ("Explain in a few sentences how a hash map works and why lookups are fast.",),
    ("Write a short story about a lighthouse keeper who finds a message in a bottle.",),
    ("What is the capital of France, and what is it famous for?",),
)


def prompts(tokenizer: Any) -> list[list[int]]:
    """Each conversation as a chat prompt: the system prompt, its turns (user, assistant, user, ...)."""
    found = []
    for turns in CONVERSATIONS:
        messages = [{"role": "system", "content": SYSTEM}]
        messages += [
            {"role": "user" if index % 2 == 0 else "assistant", "content": text} for index, text in enumerate(turns)
        ]
        found.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return found


def load(name: str, cache_dir: Path) -> tuple[Any, Any]:
    dir4 = prepare_4bit_dir(cache_dir)
    if name == "smollm2":
        return load_float32(dir4)
    from mlx_lm import load as mlx_lm_load

    directory = support.build_tiny("qwen3_next-wide", dir4, cache_dir / "bench-models" / "wide-qwen3-next")
    model, tokenizer = mlx_lm_load(str(directory))[:2]
    return model, tokenizer


def measure_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from courier.core.prompt_cache.quantization import KvQuantization

    model, tokenizer = load(name, args.cache_dir)
    quantizations = [KvQuantization(bits, args.group_size) for bits in args.bits]
    rows = []
    for index, prompt in enumerate(prompts(tokenizer)):
        started = time.perf_counter()
        drift = support.measure_drift(model, prompt, quantizations, args.tokens)
        progress(f"{name} prompt {index} ({len(prompt)} tokens): {time.perf_counter() - started:.1f} s")
        rows += [
            {"model": name, "prompt": index, "prompt_tokens": len(prompt), "stored": label, **asdict(figures)}
            for label, figures in drift.items()
        ]
    return rows


def summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and stored form, over the prompts: mean and worst of each figure."""
    keys = list(dict.fromkeys((row["model"], row["stored"]) for row in rows))
    found = []
    for model, stored in keys:
        mine = [row for row in rows if (row["model"], row["stored"]) == (model, stored)]
        firsts = [row["first_divergence"] for row in mine]
        found.append(
            {
                "model": model,
                "stored": stored,
                "prompts": len(mine),
                "mean_abs_logprob": statistics.fmean(row["mean_abs_logprob"] for row in mine),
                "max_abs_logprob": max(row["max_abs_logprob"] for row in mine),
                "top1_agreement": statistics.fmean(row["top1_agreement"] for row in mine),
                "worst_top1_agreement": min(row["top1_agreement"] for row in mine),
                "greedy_identical": sum(first is None for first in firsts),
                "first_divergence": min((first for first in firsts if first is not None), default=None),
                "mean_kl": statistics.fmean(row["mean_kl"] for row in mine),
            }
        )
    return found


def print_report(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"### Quality after a restore: the first {args.tokens} generated tokens, group size {args.group_size}\n")
    table(
        "model | stored | mean abs logprob diff | max abs logprob diff | top-1 agreement (mean, worst) "
        "| greedy identical | first divergence | mean KL (nats)",
        (
            f"{row['model']} | {row['stored']} | {row['mean_abs_logprob']:.4f} | {row['max_abs_logprob']:.4f} "
            f"| {row['top1_agreement']:.1%}, {row['worst_top1_agreement']:.1%} "
            f"| {row['greedy_identical']} of {row['prompts']} | {_position(row['first_divergence'])} "
            f"| {row['mean_kl']:.5f}"
            for row in summary(rows)
        ),
    )


def _position(value: int | None) -> str:
    return "-" if value is None else str(value)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--models", type=cli.names(MODELS), default=list(MODELS), help="smollm2,qwen3_next")
    parser.add_argument("--bits", type=cli.positive_ints, default=list(BITS), help="8,4")
    parser.add_argument("--group-size", type=int, default=64, help="32, 64 or 128 (64)")
    parser.add_argument("--tokens", type=cli.positive_int, default=128, help="generated tokens compared (128)")
    cli.add_results(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blas = load_optimized_blas()  # before MLX is imported
    with cache_directory(args.cache_dir) as cache_dir:
        args.cache_dir = cache_dir
        env = environment(blas)
        settings = {"models": args.models, "bits": args.bits, "group_size": args.group_size, "tokens": args.tokens}
        head("Quantized prompt-cache snapshots: quality after a restore", env, settings)
        rows = [row for name in args.models for row in measure_model(name, args)]
        print_report(rows, args)
        write_json({"environment": env, "settings": settings, "rows": rows, "summary": summary(rows)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
