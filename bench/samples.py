"""`n` samples of one prompt on the embedded SmolLM2: one request with `n` against `n` requests sent at once and
one after another, on one Courier server."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import openai

from bench.harness import cli
from bench.harness.clients import Streamed, async_client, stream_chat, user
from bench.harness.models import launching
from bench.harness.report import progress, table, write_json
from bench.harness.servers import COURIER, Server, ServerSpec

ARMS = ("n", "concurrent", "sequential")
SEED = 1234
TEMPERATURE = 0.8
COURIER_ID = ServerSpec(name=COURIER).model
WORDS = [
    *("harbour", "lighthouse", "keeper", "ledger", "storm", "tide", "ferry", "signal", "lantern", "cargo"),
    *("schooner", "gull", "pier", "chart", "compass", "rope", "anchor", "beacon", "fog", "horn"),
    *("dock", "mast", "sail", "reef", "current"),
]


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    round: int
    wall_s: float
    first_token_s: float
    completion_tokens: int


def document(round_index: int, words: int) -> str:
    """A different long text each round (a rotating word list, numbered sentences), so no two rounds share a prefix
    beyond the template's."""
    sentences = []
    for number in range(words // 12):
        picked = [WORDS[(round_index * 7 + number * 5 + offset * 3) % len(WORDS)] for offset in range(10)]
        sentences.append(f"Entry {round_index}.{number}: " + " ".join(picked) + ".")
    return f"Here is a harbour log.\n\n{' '.join(sentences)}\n\nIn one sentence, what is it about?"


async def run_arm(
    client: openai.AsyncOpenAI, arm: str, round_index: int, args: argparse.Namespace
) -> tuple[ArmResult, list[str]]:
    """One arm's requests: its result, and the text of each sample (choice i, or request i)."""
    n, messages = args.n, user(document(round_index, args.prompt_words))

    async def one(seed: int, n: int = 1) -> Streamed:
        return await stream_chat(
            client,
            COURIER_ID,
            messages,
            max_tokens=args.max_tokens,
            temperature=TEMPERATURE,
            seed=seed,
            n=n,
            extra_body={"cache_prompt": False},
        )

    sent = time.perf_counter()
    if arm == "n":
        replies = [await one(SEED, n)]
        texts = [replies[0].texts.get(i, "") for i in range(n)]
    else:
        if arm == "concurrent":
            replies = list(await asyncio.gather(*(one(SEED + i) for i in range(n))))
        else:
            replies = [await one(SEED + i) for i in range(n)]
        texts = [reply.text for reply in replies]
    wall = time.perf_counter() - sent
    first = min(reply.first_token for reply in replies) - sent
    return ArmResult(arm, round_index, wall, first, sum(reply.completion_tokens for reply in replies)), texts


async def measure(server: Server, args: argparse.Namespace) -> tuple[list[ArmResult], int, int]:
    """A warm-up, then rounds of the three arms in a rotating order; and how many choices equal their request."""
    results: list[ArmResult] = []
    matched = compared = 0
    async with async_client(server.base_url) as client:
        await run_arm(client, "n", -1, args)
        for round_index in range(args.rounds):
            texts: dict[str, list[str]] = {}
            for arm in ARMS[round_index % 3 :] + ARMS[: round_index % 3]:
                result, texts[arm] = await run_arm(client, arm, round_index, args)
                results.append(result)
                progress(f"round {round_index} {arm}: {result.wall_s:.2f} s")
            compared += len(texts["n"])
            matched += sum(a == b for a, b in zip(texts["n"], texts["concurrent"], strict=True))
    return results, matched, compared


def print_report(results: list[ArmResult], matched: int, compared: int, args: argparse.Namespace) -> None:
    print(
        f"`n` = {args.n}, a {args.prompt_words}-word document per round, max_tokens {args.max_tokens}, "
        f"temperature {TEMPERATURE}, "
        f"{len(results) // len(ARMS)} rounds, prompt cache off\n"
    )
    medians, rows = {}, []
    for arm in ARMS:
        mine = [result for result in results if result.arm == arm]
        medians[arm] = statistics.median(result.wall_s for result in mine)
        first = statistics.median(result.first_token_s for result in mine)
        tokens = statistics.median(result.completion_tokens for result in mine)
        rows.append(f"{arm} | {medians[arm]:.2f} | {first:.2f} | {tokens:.0f}")
    table("arm | wall time, median (s) | first token, median (s) | completion tokens, median", rows)
    print(
        f"`n` against `concurrent`: {medians['concurrent'] / medians['n']:.2f}x faster; against `sequential`: "
        f"{medians['sequential'] / medians['n']:.2f}x. Choice i equal to the request with seed + i: "
        f"{matched}/{compared}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--n", type=cli.positive_int, default=4, help="samples per request (4)")
    parser.add_argument("--rounds", type=cli.positive_int, default=5, help="rounds of the three arms (5)")
    parser.add_argument("--prompt-words", type=int, default=900, help="words of each round's document (900)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request (32)")
    cli.add_results(parser)
    args = parser.parse_args(argv)
    with launching("samples", args.cache_dir) as launcher:
        record, measured = launcher.run(ServerSpec(name=COURIER), lambda server: asyncio.run(measure(server, args)))
    if measured is None:
        progress(f"courier: {record.error}")
        return 1
    print_report(*measured, args)
    write_json(measured[0], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
