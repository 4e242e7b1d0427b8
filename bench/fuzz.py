"""Fuzz every route of a real server with schemathesis, against its own `/openapi.json`, bounded in time.

A server on a tiny random-weight llama (built on the fly, tokenizer from the embedded SmolLM2) is started on a
free port; schemathesis generates requests from the OpenAPI document for every operation (valid and invalid
bodies, query and path parameters) and checks that none is answered with a 5xx (`not_a_server_error`), that
every response stays within its documented status codes and content types, and that nothing hangs past
`--request-timeout`. After the run, `/health` must answer 200 with nothing running or waiting. From the
repository root:

    .venv/bin/python -m bench.fuzz [--max-examples 25] [--time-limit 900] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from courier.platform.blas import load_optimized_blas

load_optimized_blas()

from courier.model.gguf_convert import ensure_converted  # noqa: E402
from courier.model.progress import Progress  # noqa: E402
from courier.model.source import embedded_gguf_path  # noqa: E402
from tests.support.server import running_server  # noqa: E402
from tests.support.tiny_models import build_llama  # noqa: E402

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=25, help="examples per operation")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds the whole schemathesis run may take")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds one request may take")
    parser.add_argument("--seed", type=int, default=1, help="schemathesis's seed, for a reproducible run")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=None, help="write schemathesis's whole output here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="courier-fuzz-") as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "cache"
        smollm2 = ensure_converted(embedded_gguf_path(), cache_dir, Progress(enabled=False))
        model = build_llama(smollm2, Path(scratch) / "tiny-llama", quantized=False)
        server_args = ["--model", str(model), "--cache-dir", str(cache_dir), "--served-model-name", "tiny"]
        with running_server([*server_args, "--request-timeout", str(args.request_timeout)]) as server:
            report = fuzz(server.base_url, args)
            with httpx.Client(base_url=server.base_url, timeout=30) as http:
                health = http.get("/health")
                report["health_after"] = {"status": health.status_code, "scheduler": health.json()["scheduler"]}
            report["server_exit_code"] = server.stop()
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    healthy = report["health_after"]["status"] == 200 and report["health_after"]["scheduler"]["running"] == 0
    return 0 if report["exit_code"] == 0 and healthy and report["server_exit_code"] == 0 else 1


def fuzz(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--url",
        base_url,
        "--checks",
        CHECKS,
        "--max-examples",
        str(args.max_examples),
        "--request-timeout",
        str(args.request_timeout),
        "--workers",
        "2",
        "--max-time",
        str(int(args.time_limit)),
        "--seed",
        str(args.seed),
        "--generation-database",
        "none",
        "--no-color",
        "--suppress-health-check",
        "all",
    ]
    started = time.monotonic()
    try:
        # schemathesis stops itself at --max-time; the process gets a grace period beyond it before it counts as hung.
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.time_limit + 300, check=False)
        output, exit_code, timed_out = done.stdout + done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        exit_code, timed_out = -1, True
    if args.log is not None:
        args.log.write_text(output)
    return {
        "command": " ".join(command),
        "exit_code": exit_code,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
        "summary": [line for line in output.splitlines() if line.strip()][-40:],
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"schemathesis exit code {report['exit_code']} after {report['seconds']} s (timed out: {report['timed_out']})"
    )
    print("\n".join(report["summary"]))
    print(f"/health after: {report['health_after']}; server exit code {report['server_exit_code']}")


if __name__ == "__main__":
    sys.exit(main())
