"""`n` samples of one prompt on the embedded SmolLM2: one request with `n` against `n` requests, side by side.

What `n` buys is one prefill for every sample: the samples fork from a copy of the prompt's state
(`engine/batch_engine.py`). This measures it against what a client does without `n`, on the same server in the
same run:

- `n`: one streamed chat completion with `n` = `--n` (4);
- `concurrent`: `--n` streamed requests with `n` 1 sent at once (seeds seed..seed+n-1), which the scheduler
  gathers into one burst; Courier's in-batch shared-prefix prefill then shares their common prefix;
- `sequential`: the same `--n` requests one after another (what a client that cannot batch does).

Each request has a long prompt (a document of about `--prompt-words` words, 900, and a question about it), a
fresh document per round so no arm starts from another's state, `cache_prompt: false` so the prompt cache plays
no part, temperature 0.8 with a seed, and `max_tokens` `--max-tokens` (32; there is no `ignore_eos`, so the
completion tokens are reported beside the times). Rounds (`--rounds`, 5) run the three arms in a rotating
order. Per arm: the median wall time (first byte sent .. last answer), the median time to the first content
token of any choice, and completion tokens. Correctness beside it: the `n` arm's choice i must equal the
concurrent arm's request with seed + i (same prompt, same seed stream), which the report counts.

From the repository root:

    .venv/bin/python -m bench.samples [--n 4] [--rounds 5] [--prompt-words 900] [--max-tokens 32]
        [--cache-dir DIR] [--json PATH]

Markdown goes to stdout, progress to stderr, the server log to CACHE/bench-logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

from bench.throughput import (
    COURIER,
    HOST,
    free_port,
    make_client,
    model_id,
    running_server,
    server_command,
    server_env,
    server_extra_env,
    wait_until_ready,
)

ARMS = ("n", "concurrent", "sequential")
SEED = 1234
TEMPERATURE = 0.8
WORDS = [
    *("harbour", "lighthouse", "keeper", "ledger", "storm", "tide", "ferry", "signal", "lantern", "cargo"),
    *("schooner", "gull", "pier", "chart", "compass", "rope", "anchor", "beacon", "fog", "horn"),
    *("dock", "mast", "sail", "reef", "current"),
]


@dataclass(frozen=True, slots=True)
class Shape:
    """What every request of the run looks like."""

    n: int
    words: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Reply:
    texts: dict[int, str]  # choice index (or request index) -> text
    first_token_s: float
    completion_tokens: int


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
    return " ".join(sentences)


def messages(round_index: int, words: int) -> list[dict[str, str]]:
    text = document(round_index, words)
    return [{"role": "user", "content": f"Here is a harbour log.\n\n{text}\n\nIn one sentence, what is it about?"}]


async def stream_one(client: openai.AsyncOpenAI, body: dict[str, Any], sent: float, *, index_offset: int = 0) -> Reply:
    """Stream one request; its choices' texts, when its first content arrived (from `sent`), its completion tokens."""
    stream = await client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    first = 0.0
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.monotonic() - sent
                key = choice.index + index_offset
                texts[key] = texts.get(key, "") + choice.delta.content
    return Reply(texts=texts, first_token_s=first, completion_tokens=tokens)


async def run_arm(
    client: openai.AsyncOpenAI, arm: str, round_index: int, shape: Shape
) -> tuple[ArmResult, dict[int, str]]:
    n = shape.n
    base: dict[str, Any] = {
        "model": model_id(COURIER),
        "messages": messages(round_index, shape.words),
        "max_tokens": shape.max_tokens,
        "temperature": TEMPERATURE,
        "extra_body": {"cache_prompt": False},
    }
    sent = time.monotonic()
    if arm == "n":
        replies = [await stream_one(client, {**base, "n": n, "seed": SEED}, sent)]
    elif arm == "concurrent":
        replies = list(
            await asyncio.gather(
                *(stream_one(client, {**base, "seed": SEED + i}, sent, index_offset=i) for i in range(n))
            )
        )
    else:
        replies = [await stream_one(client, {**base, "seed": SEED + i}, sent, index_offset=i) for i in range(n)]
    wall = time.monotonic() - sent
    texts = {key: text for reply in replies for key, text in reply.texts.items()}
    first = min(reply.first_token_s for reply in replies if reply.first_token_s)
    tokens = sum(reply.completion_tokens for reply in replies)
    return ArmResult(arm, round_index, wall, first, tokens), texts


async def measure(port: int, rounds: int, shape: Shape) -> tuple[list[ArmResult], int, int]:
    client = make_client(port)
    results: list[ArmResult] = []
    matched = compared = 0
    try:
        await run_arm(client, "n", -1, shape)  # warm-up
        for round_index in range(rounds):
            order = ARMS[round_index % 3 :] + ARMS[: round_index % 3]
            texts: dict[str, dict[int, str]] = {}
            for arm in order:
                result, texts[arm] = await run_arm(client, arm, round_index, shape)
                results.append(result)
                print(f"round {round_index} {arm}: {result.wall_s:.2f} s", file=sys.stderr, flush=True)
            compared += shape.n
            matched += sum(texts["n"].get(i) == texts["concurrent"].get(i) for i in range(shape.n))
    finally:
        await client.close()
    return results, matched, compared


def report(results: list[ArmResult], matched: int, compared: int, shape: Shape) -> str:
    lines = [
        f"`n` = {shape.n}, a {shape.words}-word document per round, max_tokens {shape.max_tokens}, "
        f"temperature {TEMPERATURE}, "
        f"{len(results) // len(ARMS)} rounds, prompt cache off",
        "",
        "| arm | wall time, median (s) | first token, median (s) | completion tokens, median |",
        "|---|---|---|---|",
    ]
    medians: dict[str, float] = {}
    for arm in ARMS:
        mine = [result for result in results if result.arm == arm]
        medians[arm] = statistics.median(result.wall_s for result in mine)
        first = statistics.median(result.first_token_s for result in mine)
        tokens = statistics.median(result.completion_tokens for result in mine)
        lines.append(f"| {arm} | {medians[arm]:.2f} | {first:.2f} | {tokens:.0f} |")
    lines += [
        "",
        f"`n` against `concurrent`: {medians['concurrent'] / medians['n']:.2f}x faster; against `sequential`: "
        f"{medians['sequential'] / medians['n']:.2f}x. Choice i equal to the request with seed + i: "
        f"{matched}/{compared}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-words", type=int, default=900)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="courier-bench-"))
    port = free_port()
    log_path = cache_dir / "bench-logs" / "samples-courier.log"
    command = server_command(COURIER, port, cache_dir, None, args.n)
    env = server_env(server_extra_env(COURIER, "", cache_dir))
    with running_server(command, env, log_path) as process:
        ready = wait_until_ready(process, f"http://{HOST}:{port}/health", log_path)
        print(f"courier ready in {ready:.1f} s", file=sys.stderr, flush=True)
        shape = Shape(n=args.n, words=args.prompt_words, max_tokens=args.max_tokens)
        results, matched, compared = asyncio.run(measure(port, args.rounds, shape))
    print(report(results, matched, compared, shape))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(result) for result in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
