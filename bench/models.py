"""Two models alternating every turn on one machine with memory for one (issue 33): Courier serving both under a
budget that holds one, against two mlx_lm.server processes and against one mlx_lm.server asked for both."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness import cli
from bench.harness.clients import Messages, async_client, stream_chat
from bench.harness.models import float32_dir, launching, prepare_4bit_dir
from bench.harness.report import environment, head, ms, num, percent, progress, table, write_json
from bench.harness.servers import (
    COURIER,
    MLX_LM_4BIT,
    MLX_LM_F32,
    RUN_ERRORS,
    Launcher,
    Server,
    ServerRecord,
    ServerSpec,
)
from bench.harness.stats import median_or_none, share
from courier.platform.blas import load_optimized_blas

MLX_TWO = "mlx-two"  # two mlx_lm.server processes, one per model
MLX_ONE = "mlx-one"  # one mlx_lm.server, asked for both models by their directories
SERVERS = (COURIER, MLX_TWO, MLX_ONE)
MODELS = ("model-a", "model-b")
# Courier's budget: this many times one model's charge (weights, KV allowance, memory tier), so one fits, two not.
BUDGET_OF_ONE = 1.5
CACHE_TIER = "256MiB"  # each model's prompt-cache memory tier: a turn's snapshot (~100 MB in float32) fits
GOAL_CACHED = 0.9


@dataclass(slots=True)
class Turn:
    model: str
    turn: int  # 1-based, within its model's conversation
    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    loaded_after: int | None = None  # Courier: models loaded once the turn ended


@dataclass(slots=True)
class Run:
    server: str
    turns: list[Turn] = field(default_factory=list)
    peak_rss_bytes: int | None = None
    budget_bytes: int | None = None
    records: list[ServerRecord] = field(default_factory=list)
    error: str | None = None

    def cached_share(self) -> float | None:
        later = [turn for turn in self.turns if turn.turn >= 2 and turn.prompt_tokens]
        if not later or any(turn.cached_tokens is None for turn in later):
            return None
        return share(sum(turn.cached_tokens or 0 for turn in later), sum(turn.prompt_tokens or 0 for turn in later))


def system_prompt(model: str, words: int) -> str:
    lines = [f"You are the assistant of conversation {model}. Rule {index}: answer briefly." for index in range(words)]
    return " ".join(lines)[: words * 7]


def peak_rss(server: Server) -> int:
    """VmHWM of the server's process, in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def converse(run: Run, targets: dict[str, tuple[str, str]], args: Any, courier: Server | None) -> None:
    """Alternate the two conversations for `args.turns` turns each; `targets`: model -> (base URL, model field)."""
    histories: dict[str, Messages] = {
        model: [{"role": "system", "content": system_prompt(model, args.system_words)}] for model in MODELS
    }
    clients = {model: async_client(url) for model, (url, _) in targets.items()}
    for turn in range(1, args.turns + 1):
        for model in MODELS:
            history = histories[model]
            history.append({"role": "user", "content": f"Turn {turn}: say something about the number {turn}."})
            streamed = await stream_chat(
                clients[model], targets[model][1], history, max_tokens=args.max_tokens, label=f"{model}#{turn}"
            )
            history.append({"role": "assistant", "content": streamed.text})
            loaded = await loaded_models(courier) if courier is not None else None
            run.turns.append(
                Turn(model, turn, streamed.ttft_s, streamed.prompt_tokens, streamed.cached_tokens, loaded_after=loaded)
            )
            progress(
                f"{run.server}: {model} turn {turn}: ttft {streamed.ttft_s:.2f} s, cached {streamed.cached_tokens}"
            )
    for client in clients.values():
        await client.close()


async def loaded_models(server: Server) -> int:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        listed = (await http.get("/v1/models")).json()["data"]
    return sum(1 for model in listed if model["status"]["state"] != "not_loaded")


def model_dirs(dir4: Path, cache_dir: Path) -> dict[str, Path]:
    """Two models of different files: SmolLM2's 4-bit conversion and its float32 copy. (Two names for the very same
    files would share one prompt-cache directory, which only one loaded model holds at a time.)"""
    return {MODELS[0]: dir4, MODELS[1]: float32_dir(dir4, cache_dir)}


def one_charge(launcher: Launcher, dirs: dict[str, Path]) -> int:
    """What Courier charges one of the models, read from a server that serves it alone."""
    spec = ServerSpec(name="courier-probe", kind=COURIER, flags=courier_flags(dirs, None))
    with launcher.server(spec) as server, httpx.Client(base_url=server.base_url, timeout=300) as http:
        http.post(
            "/v1/chat/completions",
            json={"model": MODELS[0], "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        )
        model = next(entry for entry in http.get("/v1/models").json()["data"] if entry["id"] == MODELS[0])
        charged: int = model["status"]["memory"]["charged_bytes"]
    return charged


def courier_flags(dirs: dict[str, Path], budget: int | None) -> tuple[str, ...]:
    flags = [flag for model, path in dirs.items() for flag in ("--model", f"{model}={path}")]
    flags += ["--prompt-cache-snapshot-capacity-bytes", CACHE_TIER]
    return (*flags, *(("--models-memory-bytes", str(budget)) if budget is not None else ()))


def run_one(launcher: Launcher, run: Run, spec: ServerSpec, fields: dict[str, str], args: Any) -> Run:
    """`run` on one server process, each model asked for by its `fields` value: the two conversations, its peak RSS."""

    def measure(server: Server) -> None:
        targets = {model: (server.base_url, name) for model, name in fields.items()}
        asyncio.run(converse(run, targets, args, server if run.server == COURIER else None))
        run.peak_rss_bytes = peak_rss(server)

    record, _ = launcher.run(spec, measure)
    run.records.append(record)
    run.error = record.error
    return run


def run_courier(launcher: Launcher, dirs: dict[str, Path], args: Any) -> Run:
    run = Run(server=COURIER, budget_bytes=int(one_charge(launcher, dirs) * BUDGET_OF_ONE))
    spec = ServerSpec(name=COURIER, kind=COURIER, flags=courier_flags(dirs, run.budget_bytes))
    return run_one(launcher, run, spec, {model: model for model in MODELS}, args)


def run_mlx_two(launcher: Launcher, dirs: dict[str, Path], args: Any) -> Run:
    run = Run(server=MLX_TWO)
    kinds = dict(zip(MODELS, (MLX_LM_4BIT, MLX_LM_F32), strict=True))  # the float32 copy with OpenBLAS preloaded
    servers = [launcher.server(ServerSpec(name=f"{MLX_TWO}-{m}", kind=kinds[m], model_dir=dirs[m])) for m in MODELS]
    try:
        with servers[0], servers[1]:
            targets = {
                model: (server.base_url, server.spec.model) for model, server in zip(MODELS, servers, strict=True)
            }
            asyncio.run(converse(run, targets, args, None))
            run.peak_rss_bytes = sum(peak_rss(server) for server in servers)
    except RUN_ERRORS as error:  # recorded, as Launcher.run does
        run.error = f"{type(error).__name__}: {error}"
    run.records.extend(server.record for server in servers)
    return run


def run_mlx_one(launcher: Launcher, dirs: dict[str, Path], args: Any) -> Run:
    spec = ServerSpec(name=MLX_ONE, kind=MLX_LM_F32, model_dir=dirs[MODELS[0]])  # OpenBLAS for the float32 one
    return run_one(launcher, Run(server=MLX_ONE), spec, {model: str(dirs[model]) for model in MODELS}, args)


def report(runs: Sequence[Run], args: Any, env: dict[str, object]) -> None:
    head("Two models alternating every turn, memory for one", env, vars(args) | {"cache_tier": CACHE_TIER})
    rows = []
    for run in runs:
        ttfts = [turn.ttft_s for turn in run.turns]
        later = [turn.ttft_s for turn in run.turns if turn.turn >= 2]
        most = max((turn.loaded_after or 0 for turn in run.turns), default=None) if run.server == COURIER else None
        cached = run.cached_share()
        rows.append(
            f"{run.server} | {ms(median_or_none(ttfts[: len(MODELS)]))} | {ms(median_or_none(later))} | "
            f"{percent(cached)} | {num(most, 0)} | {num((run.peak_rss_bytes or 0) / 2**20, 0)} MiB | "
            f"{num(run.budget_bytes / 2**20, 0) + ' MiB' if run.budget_bytes else 'n/a'} | {run.error or 'ok'}"
        )
    table(
        "server | median TTFT, turn 1 (ms) | median TTFT, turns 2+ (ms) | cached share, turns 2+ | most loaded | "
        "peak RSS | budget | result",
        rows,
    )
    for run in runs:
        print(f"{run.server}, TTFT per turn in ms (model#turn):")
        print("  " + ", ".join(f"{turn.model[-1]}#{turn.turn} {ms(turn.ttft_s, 0)}" for turn in run.turns) + "\n")
    courier = next((run for run in runs if run.server == COURIER), None)
    if courier is not None:
        cached = courier.cached_share()
        met = cached is not None and cached >= GOAL_CACHED
        print(f"Courier's cached share of turns 2+ {percent(cached)} (goal >= {percent(GOAL_CACHED, 0)}: {met}).")
    for run in runs:
        for record in run.records:
            print(record.line())


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--turns", type=cli.positive_int, default=4, help="turns per conversation (default 4)")
    parser.add_argument(
        "--system-words", type=cli.positive_int, default=600, help="system prompt length in words (600)"
    )
    parser.add_argument("--max-tokens", type=cli.positive_int, default=16, help="tokens per reply (16)")
    parser.add_argument("--servers", type=cli.names(SERVERS), default=list(SERVERS), help="courier,mlx-two,mlx-one")
    cli.add_results(parser)
    args = parser.parse_args(argv)
    blas = load_optimized_blas()
    env = environment(blas)
    runs: list[Run] = []
    with launching("models", args.cache_dir) as launcher:
        progress("converting the embedded GGUF to a 4-bit MLX directory")
        dirs = model_dirs(prepare_4bit_dir(launcher.cache_dir), launcher.cache_dir)
        for name, run in ((COURIER, run_courier), (MLX_TWO, run_mlx_two), (MLX_ONE, run_mlx_one)):
            if name in args.servers:
                runs.append(run(launcher, dirs, args))
    report(runs, args, env)
    write_json(runs, args.json)
    return 1 if any(run.error for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
