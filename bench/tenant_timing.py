"""Can one API key learn another's prompt from timing (issue 30, item 4)? Key B's time to first token with key A's
system prompt (a guess) against another of the same length (a miss), while A's requests decode; exits 1 unless a
guess's median TTFT is at least `--bound` times a miss's."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import openai
from openai.types.chat import ChatCompletionSystemMessageParam

from bench.harness import cli
from bench.harness.clients import user
from bench.harness.report import num, progress, table, write_json
from bench.harness.runs import launching
from bench.harness.servers import COURIER, COURIER_BASELINE, Server, ServerSpec, check_baseline_tree

KEYS = ("key-a-0123456789", "key-b-0123456789")
BOUND = 0.8


@dataclass(frozen=True, slots=True)
class Probe:
    server: str
    round: int
    kind: str  # "guess" or "miss"
    ttft_s: float


def system_message(text: str) -> ChatCompletionSystemMessageParam:
    return {"role": "system", "content": text}


def system_prompt(tag: str, words: int) -> str:
    return f"You are assistant {tag}. " + " ".join(f"rule-{tag}-{number}" for number in range(words))


async def first_token(
    client: openai.AsyncOpenAI, model: str, chat: tuple[str, str], max_tokens: int, decoding: asyncio.Event
) -> float:
    """Seconds to the first content delta of (system, question) (`decoding` is set then); the stream is read to its
    end."""
    sent, messages = time.perf_counter(), [system_message(chat[0]), *user(chat[1])]
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
            decoding.set()
    return (first or time.perf_counter()) - sent


async def one_round(server: Server, name: str, index: int, args: argparse.Namespace) -> list[Probe]:
    model = server.spec.model
    url = f"{server.base_url}/v1"
    secret = system_prompt(f"a{index}", args.system_words)
    probes = []
    async with (
        openai.AsyncOpenAI(base_url=url, api_key=KEYS[0], max_retries=0) as a,
        openai.AsyncOpenAI(base_url=url, api_key=KEYS[1], max_retries=0) as b,
    ):
        decoding = [asyncio.Event(), asyncio.Event()]
        owners = [
            asyncio.create_task(first_token(a, model, (secret, f"Question {n}."), args.owner_tokens, decoding[n]))
            for n in range(2)
        ]
        for event in decoding:  # A's requests prefilled and decoding: B's probes compete with decode steps only
            await event.wait()
        order = ("guess", "miss") if index % 2 == 0 else ("miss", "guess")
        for kind in order:
            system = secret if kind == "guess" else system_prompt(f"x{index}", args.system_words)
            ttft = await first_token(b, model, (system, "Hello?"), 1, asyncio.Event())
            probes.append(Probe(name, index, kind, ttft))
        await asyncio.gather(*owners)
    return probes


def measure(server: Server, *, name: str, args: argparse.Namespace) -> list[Probe]:
    probes = []
    for index in range(args.rounds):
        probes += asyncio.run(one_round(server, name, index, args))
        progress(f"{name} round {index}: " + ", ".join(f"{p.kind} {p.ttft_s:.2f} s" for p in probes[-2:]))
    return probes


def print_report(probes: list[Probe], names: Sequence[str], args: argparse.Namespace) -> list[float | None]:
    """The table; each server's guess / miss ratio of median TTFTs (None when it failed)."""
    print(
        f"Key A: two requests in flight sharing a {args.system_words}-word system prompt; key B: one request with that "
        f"prompt (guess) or another of the same length (miss); {args.rounds} rounds, alternating order\n"
    )
    rows, ratios = [], []
    for name in names:
        guess = [p.ttft_s for p in probes if p.server == name and p.kind == "guess"]
        miss = [p.ttft_s for p in probes if p.server == name and p.kind == "miss"]
        ratios.append(ratio := statistics.median(guess) / statistics.median(miss) if guess and miss else None)
        if ratio is None:
            rows.append(f"{name} | failed | | |")
            continue
        verdict = "holds" if ratio >= args.bound else "**breaks**"
        row = f"{name} | {num(statistics.median(guess), 2)} | {num(statistics.median(miss), 2)} | {ratio:.2f}"
        rows.append(f"{row} ({verdict} the bound >= {args.bound})")
    table("server | guess TTFT median (s) | miss TTFT median (s) | guess / miss", rows)
    return ratios


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--rounds", type=cli.positive_int, default=6, help="rounds (6)")
    parser.add_argument("--system-words", type=cli.positive_int, default=200, help="system prompt words (200)")
    parser.add_argument("--owner-tokens", type=cli.positive_int, default=128, help="tokens A's requests write (128)")
    parser.add_argument("--bound", type=float, default=BOUND, help=f"least guess / miss TTFT ratio ({BOUND})")
    cli.add_baseline(parser)
    cli.add_results(parser)
    args = parser.parse_args(argv)
    flags = ("--api-key", ",".join(KEYS))
    specs = [ServerSpec(name=COURIER, flags=flags)]
    if args.baseline_tree is not None:
        check_baseline_tree(args.baseline_tree)
        specs.append(ServerSpec(name=COURIER_BASELINE, flags=flags))
    probes: list[Probe] = []
    with launching("tenant_timing", args) as launcher:
        for spec in specs:
            _, measured = launcher.run(spec, partial(measure, name=spec.name, args=args))
            probes.extend(measured or [])
    ratios = print_report(probes, [spec.name for spec in specs], args)
    write_json(probes, args.json)
    return 0 if ratios[0] is not None and ratios[0] >= args.bound else 1


if __name__ == "__main__":
    sys.exit(main())
