"""Another client's small chat while a hostile grammar request runs (issue 30, items 7 and 8): each shape of
tests/support/hostile_grammars.py once on the embedded SmolLM2 (`--wide-window`: the tiny 32K-window llama), with
two-token chats sent one after another beside it. Exits 1 when a shape's chats miss the bound (median at most 3 s,
worst at most 10 s)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.harness import cli, support
from bench.harness.models import prepare_4bit_dir
from bench.harness.report import num, progress, table, write_json
from bench.harness.runs import launching
from bench.harness.servers import COURIER, COURIER_BASELINE, Server, ServerSpec
from bench.harness.stats import percentile

MEDIAN_BOUND_S = 3.0  # "a small chat is answered within a few seconds": its median and its worst
WORST_BOUND_S = 10.0
ALONE_CHATS = 5
TIMEOUT_S = 600.0
WIDE_MODEL = "wide-window-llama"


@dataclass(slots=True)
class ShapeResult:
    server: str
    shape: str
    status: int | str = ""
    finish: str = ""
    seconds: float = 0.0
    prompt_tokens: int | None = None
    chats_s: list[float] = field(default_factory=list)
    chat_failures: int = 0
    load: float = field(default_factory=lambda: os.getloadavg()[0])  # the 1-minute load average before it was sent


async def small_chats(
    client: httpx.AsyncClient, model: str, result: ShapeResult, most: int, beside: asyncio.Task[Any] | None = None
) -> None:
    """Two-token chats one after another, at most `most`, while `beside` runs (None: `most` of them)."""
    body = support.hostile_grammars().small_chat_body(model)
    while (beside is None or not beside.done()) and len(result.chats_s) + result.chat_failures < most:
        started = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=body)
        if reply.status_code == 200:
            result.chats_s.append(time.perf_counter() - started)
        else:
            result.chat_failures += 1


async def one_shape(server: Server, shape: str | None, args: argparse.Namespace) -> ShapeResult:
    """The hostile request of `shape` with small chats beside it (None: the small chat alone)."""
    model = server.spec.model
    result = ShapeResult(server=server.spec.name, shape=shape or "(none: the small chat alone)")
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        if shape is None:
            await small_chats(client, model, result, ALONE_CHATS)
            return result
        started = time.perf_counter()
        body = support.hostile_grammars().hostile_body(model, shape, args.max_tokens)
        hostile = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await asyncio.sleep(args.head_start)
        await small_chats(client, model, result, args.chats, hostile)
        reply = await hostile
        result.seconds = time.perf_counter() - started
    result.status, answer = reply.status_code, reply.json()
    if reply.status_code == 200:
        result.finish, result.prompt_tokens = answer["choices"][0]["finish_reason"], answer["usage"]["prompt_tokens"]
    else:
        result.finish = f"{answer['error']['code']} ({answer['error']['param']})"
    progress(f"{server.spec.name}: {shape}: {result.status} {result.finish} in {result.seconds:.1f} s")
    return result


def within_bound(result: ShapeResult) -> bool:
    """Its small chats all answered, their median and worst within the bound (true when none were sent)."""
    chats = sorted(result.chats_s)
    if not chats:
        return result.chat_failures == 0
    return percentile(chats, 0.5) <= MEDIAN_BOUND_S and chats[-1] <= WORST_BOUND_S and result.chat_failures == 0


def row(result: ShapeResult) -> str:
    chats = sorted(result.chats_s)
    within = "n/a" if not chats else ("yes" if within_bound(result) else "**no**")
    answer = f"{result.status} {result.finish} in {result.seconds:.1f} s" if result.status else ""
    answer += f" ({result.prompt_tokens} prompt tokens)" if result.prompt_tokens is not None else ""
    median, worst = num(percentile(chats, 0.5) if chats else None), num(chats[-1] if chats else None)
    chat_cells = f"{len(chats)} | {median} | {worst} | {within}"
    return f"{result.server} | {result.shape} | {answer} | {chat_cells} | {result.load:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    shapes = list(support.hostile_grammars().ALL_SHAPES)
    parser = cli.parser(__doc__)
    parser.add_argument("--shapes", type=cli.names(shapes), default=shapes, help="the shapes to send (all)")
    parser.add_argument("--servers", type=cli.names((COURIER, COURIER_BASELINE)), default=None)
    parser.add_argument("--max-tokens", type=cli.positive_int, default=64, help="the hostile request's (64)")
    parser.add_argument("--chats", type=cli.positive_int, default=8, help="most small chats per shape (8)")
    parser.add_argument("--head-start", type=float, default=0.05, help="seconds before the first small chat (0.05)")
    parser.add_argument("--wide-window", action="store_true", help="the tiny 32K-window llama, not SmolLM2")
    cli.add_baseline(parser)
    cli.add_results(parser)
    args = parser.parse_args(argv)
    servers = cli.choose_servers(parser, "--servers", args.servers, [COURIER], args.baseline_tree)
    results: list[ShapeResult] = []
    with launching("hostile_grammars", args) as launcher:
        model_dir = None
        if args.wide_window:
            target = launcher.cache_dir / "bench-models" / WIDE_MODEL
            model_dir = support.hostile_grammars().build_wide_window_llama(prepare_4bit_dir(launcher.cache_dir), target)
        for name in servers:
            spec = ServerSpec(name=name, model_dir=model_dir, served_name=WIDE_MODEL if model_dir else None)
            _, measured = launcher.run(
                spec, lambda s: [asyncio.run(one_shape(s, x, args)) for x in [None, *args.shapes]]
            )
            results.extend(measured or [])
    print("\n".join(record.line() for record in launcher.records) + "\n")
    print(
        f"the hostile request asks for {args.max_tokens} tokens; small chats: 2 tokens each, one after another from "
        f"{args.head_start:g} s after it while it runs\n"
    )
    bound = f"p50 <= {MEDIAN_BOUND_S:g} s and max <= {WORST_BOUND_S:g} s"
    table(
        f"server | hostile request | it got | small chats | p50 (s) | max (s) | {bound} | load before",
        map(row, results),
    )
    write_json(results, args.json)
    missed = [f"{result.server}: {result.shape}" for result in results if not within_bound(result)]
    if missed:
        print(f"\nsmall chats outside the bound beside: {'; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
