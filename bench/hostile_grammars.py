"""Another client's small chat while a hostile grammar request runs (issue 30, items 7 and 8), on the embedded SmolLM2.

Each shape of tests/support/hostile_grammars.py is sent once: the three JSON schemas no generation can follow (no
finite instance, `anyOf` 8x8x8, 2,000 properties), the control, and the four tool sets (128 functions with
`tool_choice: "required"`, a function of 600 optional properties, 128 functions with pattern bombs, a JSON schema
beside 128 tools in `auto`). The control sends the prompt the 128 functions render to as plain messages: as long,
and nothing constrained, so what a long prefill costs the small chats is told apart from what grammar work costs
them. `--head-start` (0.05 s) later, two-token chats are sent one after another while it runs (at most `--chats`).
Reported: what the hostile request got (status, finish reason or error code and param, seconds), the small chats'
latency against the bound (median at most 3 s, worst at most 10 s; the bench exits 1 when a shape's chats miss it)
and, for comparison, the small chat alone; with the load average before each. `courier-baseline` (`--baseline-tree
DIR`) measures another commit the same way; `--wide-window` serves the tiny random llama with a 32K window instead,
where every shape's prompt fits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx

from bench.harness import cli, support
from bench.harness.models import cache_directory, prepare_4bit_dir
from bench.harness.report import num, progress, table, write_json
from bench.harness.servers import COURIER, COURIER_BASELINE, Launcher, Server, ServerSpec
from bench.harness.stats import percentile

# "While any such request runs, a small chat is answered within a few seconds": the bound each shape's small chats
# are held to, their median and their worst. The bench exits 1 when a shape's chats miss it.
MEDIAN_BOUND_S = 3.0
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
    load: float = 0.0  # the 1-minute load average before it was sent


async def small_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> float | None:
    started = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json=body)
    return time.perf_counter() - started if reply.status_code == 200 else None


async def one_shape(server: Server, shape: str, args: argparse.Namespace) -> ShapeResult:
    shapes = support.hostile_grammars()
    model = server.spec.model
    result = ShapeResult(server=server.spec.name, shape=shape, load=os.getloadavg()[0])
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        started = time.perf_counter()
        hostile = asyncio.create_task(
            client.post("/v1/chat/completions", json=shapes.hostile_body(model, shape, args.max_tokens))
        )
        await asyncio.sleep(args.head_start)
        while not hostile.done() and len(result.chats_s) + result.chat_failures < args.chats:
            latency = await small_chat(client, shapes.small_chat_body(model))
            if latency is None:
                result.chat_failures += 1
            else:
                result.chats_s.append(latency)
        reply = await hostile
        result.seconds = time.perf_counter() - started
    result.status = reply.status_code
    body = reply.json()
    if reply.status_code == 200:
        result.finish = body["choices"][0]["finish_reason"]
    else:
        result.finish = f"{body['error']['code']} ({body['error']['param']})"
    result.prompt_tokens = body["usage"]["prompt_tokens"] if reply.status_code == 200 else None
    return result


async def alone(server: Server) -> ShapeResult:
    result = ShapeResult(server=server.spec.name, shape="(none: the small chat alone)", load=os.getloadavg()[0])
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        for _ in range(ALONE_CHATS):
            latency = await small_chat(client, support.hostile_grammars().small_chat_body(server.spec.model))
            if latency is not None:
                result.chats_s.append(latency)
    return result


def measure(server: Server, args: argparse.Namespace) -> list[ShapeResult]:
    results = [asyncio.run(alone(server))]
    for shape in args.shapes:
        result = asyncio.run(one_shape(server, shape, args))
        progress(f"{server.spec.name}: {shape}: {result.status} {result.finish} in {result.seconds:.1f} s")
        results.append(result)
    return results


def within_bound(result: ShapeResult) -> bool:
    """Its small chats all answered, their median and worst within the bound (true when none were sent)."""
    chats = sorted(result.chats_s)
    if not chats:
        return result.chat_failures == 0
    return percentile(chats, 0.5) <= MEDIAN_BOUND_S and chats[-1] <= WORST_BOUND_S and result.chat_failures == 0


def print_report(results: Sequence[ShapeResult], args: argparse.Namespace) -> None:
    print(
        f"the hostile request asks for {args.max_tokens} tokens; small chats: 2 tokens each, one after another from "
        f"{args.head_start:g} s after it while it runs\n"
    )
    rows = []
    for result in results:
        chats = sorted(result.chats_s)
        worst = chats[-1] if chats else None
        within = "n/a" if not chats else ("yes" if within_bound(result) else "**no**")
        answer = f"{result.status} {result.finish} in {result.seconds:.1f} s" if result.status else ""
        if result.prompt_tokens is not None:
            answer += f" ({result.prompt_tokens} prompt tokens)"
        median = num(percentile(chats, 0.5) if chats else None)
        chat_cells = f"{len(chats)} | {median} | {num(worst)} | {within}"
        rows.append(f"{result.server} | {result.shape} | {answer} | {chat_cells} | {result.load:.1f}")
    table(
        f"server | hostile request | it got | small chats | p50 (s) | max (s) | p50 <= {MEDIAN_BOUND_S:g} s and max <= "
        f"{WORST_BOUND_S:g} s | load before",
        rows,
    )


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
    with cache_directory(args.cache_dir) as cache_dir:
        launcher = Launcher(
            bench="hostile_grammars",
            cache_dir=cache_dir,
            log_dir=cache_dir / "bench-logs",
            baseline_tree=args.baseline_tree,
        )
        model_dir = None
        if args.wide_window:
            target = cache_dir / "bench-models" / WIDE_MODEL
            model_dir = support.hostile_grammars().build_wide_window_llama(prepare_4bit_dir(cache_dir), target)
        for name in servers:
            spec = ServerSpec(name=name, model_dir=model_dir, served_name=WIDE_MODEL if model_dir else None)
            _, measured = launcher.run(spec, partial(measure, args=args))
            results.extend(measured or [])
    for record in launcher.records:
        print(record.line())
    print()
    print_report(results, args)
    write_json(results, args.json)
    missed = [f"{result.server}: {result.shape}" for result in results if not within_bound(result)]
    if missed:
        print(f"\nsmall chats outside the bound beside: {'; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
