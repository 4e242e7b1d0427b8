"""A long prompt admitted beside running streams, on the embedded SmolLM2 (issue 36): the streams' inter-token gaps
while it prefills, its TTFT and a short request's beside it; Courier with and without its prefill budget, and
mlx_lm.server on the same float32 weights. Exits 1 when the budget misses its bound."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import openai

from bench.harness import cli
from bench.harness.clients import async_client, user
from bench.harness.models import float32_dir, prepare_4bit_dir
from bench.harness.report import ms, num, progress, table, verdict, write_json
from bench.harness.runs import launching
from bench.harness.servers import COURIER, MLX_LM_F32, Server, ServerSpec, tuned_flags
from bench.harness.stats import percentile

ARMS = ("courier", "courier-no-budget", MLX_LM_F32)
END_TOKENS_BANNED = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|>: every stream runs to its max_tokens


@dataclass(slots=True)
class Stream:
    """One streamed chat completion's content deltas, timed on `time.perf_counter()`."""

    sent: float
    stamps: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RoundResult:
    arm: str
    round: int
    long_ttft_s: float
    short_ttft_s: float
    gaps_s: tuple[float, ...]  # the running streams' gaps that overlap the long prompt's wait for its first token


async def streamed(client: openai.AsyncOpenAI, model: str, text: str, max_tokens: int, into: Stream) -> None:
    bias = END_TOKENS_BANNED
    response = await client.chat.completions.create(
        model=model, messages=user(text), max_tokens=max_tokens, temperature=0, stream=True, logit_bias=bias
    )
    async for chunk in response:
        if chunk.choices and chunk.choices[0].delta.content:
            into.stamps.append(time.perf_counter())


def long_prompt(round_index: int, words: int) -> str:
    """A document no other round shares a prefix with (the template's aside)."""
    return f"Document {round_index}.\n" + " ".join(f"item{round_index}-{number}" for number in range(words))


async def one_round(server: Server, arm: str, round_index: int, args: argparse.Namespace) -> RoundResult:
    model = server.spec.model
    async with async_client(server.base_url) as client:
        streams = [Stream(time.perf_counter()) for _ in range(args.streams)]
        running = [
            asyncio.create_task(streamed(client, model, f"Tell story {round_index}.{i}.", args.stream_tokens, stream))
            for i, stream in enumerate(streams)
        ]
        while any(len(stream.stamps) < 2 for stream in streams):  # every stream decoding
            await asyncio.sleep(0.05)
        long, short = Stream(time.perf_counter()), Stream(time.perf_counter())
        await asyncio.gather(
            streamed(client, model, long_prompt(round_index, args.long_words), 4, long),
            streamed(client, model, f"Say hi {round_index}.", 4, short),
        )
        await asyncio.gather(*running)
    start, first = long.sent, long.stamps[0]
    gaps = tuple(
        later - earlier
        for stream in streams
        for earlier, later in zip(stream.stamps, stream.stamps[1:], strict=False)
        if later > start and earlier < first
    )
    return RoundResult(arm, round_index, first - long.sent, short.stamps[0] - short.sent, gaps)


def measure(server: Server, *, arm: str, args: argparse.Namespace) -> list[RoundResult]:
    asyncio.run(one_round(server, arm, -1, args))  # a warm-up round
    results = []
    for round_index in range(args.rounds):
        result = asyncio.run(one_round(server, arm, round_index, args))
        progress(f"{arm} round {round_index}: long TTFT {result.long_ttft_s:.1f} s")
        results.append(result)
    return results


def spec(arm: str, f32_dir: Path | None, args: argparse.Namespace) -> ServerSpec:
    if arm == "courier":
        return ServerSpec(name=arm, kind=COURIER)
    if arm == "courier-no-budget":
        return ServerSpec(name=arm, kind=COURIER, flags=("--prefill-stall-ms", "0"))
    return ServerSpec(name=arm, kind=MLX_LM_F32, model_dir=f32_dir, flags=tuned_flags(args.streams + 2))


# The bound: with its prefill budget Courier's streams' gap p95 and a short request's TTFT while a long prompt is
# admitted are at most half of what they are without it (a whole prefill chunk each step, mlx-lm's way).
BOUND = 0.5


def bounds(results: list[RoundResult]) -> dict[str, float] | None:
    """Courier's figures over courier-no-budget's (gap p95, short TTFT p50), when both arms ran."""
    by_arm = {arm: [result for result in results if result.arm == arm] for arm in ("courier", "courier-no-budget")}
    if not all(by_arm.values()):
        return None

    def gap_p95(arm: str) -> float:
        return percentile([gap for result in by_arm[arm] for gap in result.gaps_s], 0.95)

    def short_p50(arm: str) -> float:
        return percentile(sorted(result.short_ttft_s for result in by_arm[arm]), 0.5)

    return {
        "gap p95": gap_p95("courier") / gap_p95("courier-no-budget"),
        "short TTFT": short_p50("courier") / short_p50("courier-no-budget"),
    }


def print_report(results: list[RoundResult], args: argparse.Namespace) -> None:
    print(
        f"{args.streams} streams of {args.stream_tokens} tokens decoding; a prompt of {args.long_words} words "
        f"(~{args.long_words * 4} tokens) and a short one sent beside them; {args.rounds} rounds per arm\n"
    )
    rows = []
    for arm in args.arms:
        mine = [result for result in results if result.arm == arm]
        if not mine:
            rows.append(f"{arm} | failed | | | | |")
            continue
        gaps = [gap for result in mine for gap in result.gaps_s]
        long = sorted(result.long_ttft_s for result in mine)
        short = sorted(result.short_ttft_s for result in mine)
        rows.append(
            f"{arm} | {ms(percentile(gaps, 0.5), 0)} | {ms(percentile(gaps, 0.95), 0)} | {ms(max(gaps), 0)} | "
            f"{num(percentile(long, 0.5))} | {num(percentile(short, 0.5))}"
        )
    gap_cells = "streams' gap p50 (ms) | gap p95 (ms) | gap max (ms)"
    table(f"arm | {gap_cells} | long prompt TTFT p50 (s) | short TTFT p50 (s)", rows)
    ratios = bounds(results)
    if ratios is not None:
        print("\nCourier with its prefill budget over Courier without it:")
        for name, ratio in ratios.items():
            print(f"- {name}: {verdict(ratio, BOUND, at_most=True)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--arms", type=cli.names(ARMS), default=list(ARMS), help=f"({','.join(ARMS)})")
    parser.add_argument("--streams", type=cli.positive_int, default=8, help="running streams (8)")
    parser.add_argument("--stream-tokens", type=cli.positive_int, default=256, help="tokens each stream writes (256)")
    parser.add_argument("--long-words", type=cli.positive_int, default=750, help="words of the long prompt (750)")
    parser.add_argument("--rounds", type=cli.positive_int, default=2, help="rounds per arm (2)")
    cli.add_results(parser, openblas=MLX_LM_F32)
    args = parser.parse_args(argv)
    results: list[RoundResult] = []
    with launching("fairness", args) as launcher:
        cache_dir = launcher.cache_dir
        f32 = float32_dir(prepare_4bit_dir(cache_dir), cache_dir) if MLX_LM_F32 in args.arms else None
        for arm in args.arms:
            _, measured = launcher.run(spec(arm, f32, args), partial(measure, arm=arm, args=args))
            results.extend(measured or [])
    print_report(results, args)
    write_json(results, args.json)
    ratios = bounds(results)
    return 1 if ratios is not None and any(ratio > BOUND for ratio in ratios.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
