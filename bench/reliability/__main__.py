"""Reliability of Courier under load and faults, on a tiny random-weight llama: overload, disconnects, a soak,
`kill -9` with stored responses, and SIGTERM mid-stream. Each part checks invariants; the exit code is 1 when one
fails."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness import cli
from bench.harness.models import cache_directory, prepare_4bit_dir, tiny_model
from bench.harness.report import environment, progress, table, write_json
from bench.harness.servers import Launcher
from bench.reliability.common import PARTS, REPO_ROOT, SERVED, PartResult, Setup
from bench.reliability.kill import run_kill
from bench.reliability.soak import run_soak
from bench.reliability.storm import run_storm
from bench.reliability.streams import run_disconnects, run_load, run_shutdown
from courier.platform.blas import load_optimized_blas

RUNNERS: dict[str, Callable[[Setup], PartResult]] = {
    "load": run_load,
    "disconnects": run_disconnects,
    "soak": run_soak,
    "kill": run_kill,
    "shutdown": run_shutdown,
    "storm": run_storm,
}


def source_state() -> dict[str, object]:
    """The checkout measured (read-only git commands; the working tree may differ from HEAD)."""

    def git(*argv: str) -> str:
        command = ["git", "--no-optional-locks", *argv]
        try:
            return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line[3:].startswith("courier/")]
    return {"head": git("rev-parse", "--short", "HEAD"), "courier_files_changed_from_head": changed}


def print_report(
    env: dict[str, object], source: dict[str, object], settings: dict[str, object], parts: Sequence[PartResult]
) -> None:
    print("## Courier reliability\n")
    versions = ", ".join(f"{name} {env[name]}" for name in ("mlx", "mlx-lm", "courier", "openai"))
    print(f"- python {env['python']}, {versions}")
    print(f"- machine: {env['platform']} ({env['machine']}), {env['cpu_count']} CPUs")
    changed = source["courier_files_changed_from_head"]
    print(f"- source: HEAD {source['head']}" + (f", working tree differs in {changed}" if changed else ""))
    print(f"- model: tiny random-weight llama (tests/support/tiny_models.py), served as `{SERVED}`")
    print(f"- settings: {settings}\n")
    for part in parts:
        print(f"### {part.name}: {'PASS' if part.passed else 'FAIL'}\n")
        print(f"Command: `.venv/bin/python -m {part.command}`\n")
        for command in part.server_commands:
            print(f"Server: `{command}`\n")
        if part.error is not None:
            print(f"**Error:** {part.error}\n")
        if part.rows:
            table("figure | value", (f"{metric} | {value.replace('|', '/')}" for metric, value in part.rows))
        if part.checks:
            rows = (f"{c.name} | {'pass' if c.passed else 'FAIL'} | {c.detail.replace('|', '/')}" for c in part.checks)
            table("check | result | detail", rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.prog = "python -m bench.reliability"
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(PARTS), help=f"parts to run ({','.join(PARTS)})")
    add("--seed", type=int, default=0, help="random seed (0)")
    add("--hang-bound", type=float, default=120.0, help="seconds a client may take before it counts as hung (120)")
    add("--load-waves", type=int, default=3, help="load: waves of concurrent clients (3)")
    add("--load-clients", type=int, default=64, help="load: concurrent streaming clients per wave (64)")
    add("--load-max-tokens", type=int, default=64, help="load: max_tokens per request (64)")
    add("--load-probes", type=int, default=20, help="load: requests sent one by one while the queue is full (20)")
    add("--disconnect-requests", type=int, default=200, help="disconnects: requests (200)")
    add("--disconnect-max-tokens", type=int, default=256, help="disconnects: max_tokens per request (256)")
    add("--disconnect-max-chunks", type=int, default=32, help="disconnects: most chunks read before closing (32)")
    add("--soak-seconds", type=float, default=180.0, help="soak: seconds of traffic (180)")
    add("--sample-every", type=float, default=2.0, help="soak: seconds between samples (2)")
    add("--soak-snapshot-capacity", default="4MiB", help="soak: --prompt-cache-snapshot-capacity-bytes (4MiB)")
    add("--soak-mlx-cache-limit", default=None, help="soak: the server's --mlx-cache-limit (its default when unset)")
    add("--kill-writers", type=int, default=4, help="kill: client threads (4)")
    add("--kill-after", type=float, default=10.0, help="kill: seconds of traffic before SIGKILL (10)")
    add("--shutdown-timeout", type=float, default=5.0, help="shutdown: the server's --shutdown-timeout (5)")
    add("--exit-slack", type=float, default=5.0, help="shutdown: seconds allowed past the timeout to exit (5)")
    add("--storm-rounds", type=int, default=8, help="storm: rounds of clients that send and leave (8)")
    add("--storm-clients", type=int, default=200, help="storm: clients a round, sent from 4 threads (200)")
    add("--storm-max-tokens", type=int, default=64, help="storm: max_tokens per request (64)")
    add("--storm-burners", type=int, default=3, help="storm: CPU-bound processes run beside the server (3)")
    add("--log-dir", type=Path, default=None, help="server logs (default: CACHE/bench-logs)")
    cli.add_results(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    blas = load_optimized_blas()  # before MLX is imported, as the server does
    parts: list[PartResult] = []
    with cache_directory(args.cache_dir) as cache_dir:
        log_dir = (args.log_dir or cache_dir / "bench-logs").resolve()
        progress("converting the embedded GGUF (the tiny model borrows its tokenizer)")
        model_dir = tiny_model("llama", prepare_4bit_dir(cache_dir), cache_dir)
        launcher = Launcher(bench="reliability", cache_dir=cache_dir, log_dir=log_dir)
        setup = Setup(launcher=launcher, model_dir=model_dir, args=args)
        for name in args.parts:
            progress(f"part {name}")
            try:
                parts.append(RUNNERS[name](setup))
            except Exception as error:  # one part's crash is reported, the others still run
                progress(f"{name}: FAILED: {type(error).__name__}: {error}")
                failed = f"{type(error).__name__}: {error}"
                parts.append(PartResult(name=name, command=f"bench.reliability --parts {name}", error=failed))
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    env, source = environment(blas), source_state()
    print_report(env, source, settings, parts)
    write_json({"environment": env, "source": source, "settings": settings, "parts": parts}, args.json)
    return 0 if all(part.passed for part in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
