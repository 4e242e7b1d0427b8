"""Decode speed with the running batch's attention KV quantized (`--kv-bits`) against full precision, on the
embedded SmolLM2: Courier started with --kv-bits off, 8 and 4 in turn, each measured at 1 stream (median decode
tok/s of a few essays) and at 8 concurrent streams (all tokens / wall time, and the median stream's decode tok/s)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.harness import cli
from bench.harness.clients import async_client, burst, stream_chat, user
from bench.harness.models import WARMUP_PROMPT, launching
from bench.harness.report import environment, head, progress, table, write_json
from bench.harness.servers import COURIER, Server, ServerSpec
from bench.throughput import essay_prompts
from courier.platform.blas import load_optimized_blas

ARMS = {"off": (), "8": ("--kv-bits", "8"), "4": ("--kv-bits", "4")}


@dataclass(slots=True)
class Arm:
    bits: str
    single_tps: list[float] = field(default_factory=list)  # one stream: each essay's decode tok/s
    burst_tps: list[float] = field(default_factory=list)  # 8 streams: all tokens / wall, per round
    burst_stream_tps: list[float] = field(default_factory=list)  # 8 streams: each stream's decode tok/s
    error: str | None = None


async def measure(server: Server, arm: Arm, args: argparse.Namespace) -> None:
    model = server.spec.model
    async with async_client(server.base_url) as client:
        await stream_chat(client, model, user(WARMUP_PROMPT), max_tokens=args.max_tokens)
        for prompt in essay_prompts(args.repeats):
            streamed = await stream_chat(client, model, user(prompt), max_tokens=args.max_tokens, label=prompt)
            arm.single_tps.append(streamed.decode_tps)
        for _ in range(args.repeats):
            pending = [
                stream_chat(client, model, user(prompt), max_tokens=args.max_tokens, label=prompt)
                for prompt in essay_prompts(args.streams)
            ]
            done = await burst(pending)
            arm.burst_tps.append(done.tps)
            arm.burst_stream_tps.extend(stream.decode_tps for stream in done.streams)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--arms", type=cli.names(tuple(ARMS)), default=list(ARMS), help="--kv-bits values to run (off,8,4)")
    add("--streams", type=int, default=8, help="concurrent streams of the batched measure (8)")
    add("--max-tokens", type=int, default=96, help="completion tokens per request (96)")
    add("--repeats", type=int, default=3, help="single-stream essays, and 8-stream rounds, per arm (3)")
    cli.add_results(parser)
    return parser.parse_args(argv)


def report(arms: Sequence[Arm], args: argparse.Namespace, env: dict[str, object]) -> None:
    head("Decode with a quantized batch KV (--kv-bits)", env, vars(args) | {"json": str(args.json)})
    off = next((arm for arm in arms if arm.bits == "off" and arm.single_tps and arm.burst_tps), None)

    def relative(value: float, base: float | None) -> str:
        return f"{value / base:.2f}x" if base else "-"

    base_single = statistics.median(off.single_tps) if off else None
    base_burst = statistics.median(off.burst_tps) if off else None
    rows = []
    for arm in arms:
        if arm.error or not arm.single_tps or not arm.burst_tps:
            rows.append(f"{arm.bits} | failed: {arm.error} | | | | ")
            continue
        single, batched = statistics.median(arm.single_tps), statistics.median(arm.burst_tps)
        per_stream = statistics.median(arm.burst_stream_tps)
        rows.append(
            f"{arm.bits} | {single:.1f} | {relative(single, base_single)} | {batched:.1f} | "
            f"{relative(batched, base_burst)} | {per_stream:.1f}"
        )
    table(
        f"--kv-bits | 1 stream decode tok/s | vs off | {args.streams} streams tok/s | vs off | "
        f"{args.streams} streams, median stream's decode tok/s",
        rows,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blas = load_optimized_blas()
    arms: list[Arm] = []
    with launching("kv-bits", args.cache_dir, kernels=blas.kernels) as launcher:
        for bits in args.arms:
            arm = Arm(bits=bits)
            arms.append(arm)
            progress(f"--kv-bits {bits}: 1 stream x {args.repeats}, {args.streams} streams x {args.repeats}")
            spec = ServerSpec(name=f"courier-kv-{bits}", kind=COURIER, flags=ARMS[bits])

            def measured(server: Server, arm: Arm = arm) -> None:
                asyncio.run(measure(server, arm, args))

            record, _ = launcher.run(spec, measured)
            arm.error = record.error
    env = environment(blas)
    report(arms, args, env)
    write_json({"environment": env, "settings": vars(args) | {"json": str(args.json)}, "arms": arms}, args.json)
    return 1 if any(arm.error for arm in arms) else 0


if __name__ == "__main__":
    sys.exit(main())
