"""Fuzz every route of a real server on a tiny random-weight model: schemathesis from its /openapi.json, then the
hostile cases of bench/hostile/; nothing may answer 5xx, hang, log an error or stop the server."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import cli
from bench.harness.models import prepare_4bit_dir, tiny_model, tiny_vision_model
from bench.harness.report import progress, table, write_json
from bench.harness.servers import COURIER, Launcher, ServerSpec
from bench.hostile import tenants
from bench.hostile.prober import (
    LOG_HEAD,
    Answer,
    FamilyRun,
    Health,
    Prober,
    is_error,
    log_records,
    shorten,
    statuses_text,
)
from courier.platform.blas import load_optimized_blas

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance"
PHASES = ("schema", "hostile")
TEXT_MODEL = "tiny"
VISION_MODEL = "tiny-vision"


@dataclass(slots=True, kw_only=True)
class FuzzedServer:
    name: str
    command: str
    schema: dict[str, Any] | None = None
    schema_health: Health | None = None  # right after the schema phase
    families: list[FamilyRun] = field(default_factory=list)
    health_after: Health | None = None
    exit_code: int | None = None
    log_errors: list[str] = field(default_factory=list)
    log_path: str | None = None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--phases", type=cli.names(PHASES), default=list(PHASES), help="phases to run (schema,hostile)")
    add("--max-examples", type=int, default=25, help="schema: examples per operation (25)")
    add("--time-limit", type=float, default=900.0, help="schema: seconds the whole schemathesis run may take (900)")
    add("--request-timeout", type=float, default=60.0, help="seconds one request may take, server and client (60)")
    add("--seed", type=int, default=1, help="seed of schemathesis and of the hostile generators (1)")
    add("--hostile-cases", type=int, default=300, help="hostile: most cases per family, follow-ups aside (300)")
    add("--no-vision", dest="vision", action="store_false", help="hostile: skip the vision model's server")
    add("--families", type=lambda text: set(text.split(",")), default=None, help="hostile: only these, e.g. sampling")
    cli.add_results(parser)
    add("--log", type=Path, default=None, help="write schemathesis's output here, and each server's log beside it")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_optimized_blas()  # before MLX is imported
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="courier-fuzz-") as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "cache"
        log_dir = args.log.parent if args.log is not None else cache_dir / "bench-logs"
        launcher = Launcher(bench="fuzz", cache_dir=cache_dir, log_dir=log_dir)
        model = tiny_model("llama", prepare_4bit_dir(cache_dir), cache_dir)
        servers = [run_server(launcher, "text", TEXT_MODEL, model, args, phases=args.phases)]
        if "hostile" in args.phases and (args.families is None or "tenants" in args.families):
            servers.append(run_server(launcher, "keyed", TEXT_MODEL, model, args, phases=["hostile"], keyed=True))
        if "hostile" in args.phases and args.vision:
            if (vision := tiny_vision_model(Path(scratch) / "tiny-vision")) is None:
                progress("mlx-vlm is not installed: no vision server")
            else:
                servers.append(run_server(launcher, "vision", VISION_MODEL, vision, args, phases=["hostile"]))
    seconds = round(time.monotonic() - started, 1)
    print_report(servers, args, seconds)
    report = {"phases": args.phases, "seed": args.seed, "hostile_cases_per_family": args.hostile_cases}
    report |= {"request_timeout_s": args.request_timeout, "seconds": seconds, "passed": passed(servers)}
    write_json(report | {"servers": servers}, args.json)
    return 0 if passed(servers) else 1


def run_server(
    launcher: Launcher,
    name: str,
    served: str,
    model: Path,
    args: argparse.Namespace,
    *,
    phases: Sequence[str],
    keyed: bool = False,
) -> FuzzedServer:
    """Start a server for `model` (`keyed`: with API keys, for the tenants family), run `phases` against it, check its
    health, and stop it."""
    flags = ("--request-timeout", str(args.request_timeout), *(tenants.FLAGS if keyed else ()))
    server = launcher.server(ServerSpec(name=name, kind=COURIER, model_dir=model, served_name=served, flags=flags))
    run = FuzzedServer(name=name, command=server.record.command_text(), log_path=server.record.log_path)
    with server:
        api_key = tenants.OWNER if keyed else ""
        prober = Prober(server, served, args.request_timeout, vision=name == "vision", api_key=api_key)
        if "schema" in phases:
            run.schema = schema_phase(server.base_url, args)
            run.schema_health = prober.health()
        if "hostile" in phases:
            run.families = prober.run_families(name, args)
        run.health_after = prober.health()
        prober.close()
        run.exit_code = server.stop() if server.poll() is None else server.poll()
        run.log_errors = [record[0] for record in log_records(server.lines) if is_error(record)]
    return run


def passed(servers: Sequence[FuzzedServer]) -> bool:
    for server in servers:
        if server.schema is not None and (server.schema["exit_code"] != 0 or not healthy(server.schema_health)):
            return False
        if any(family.problems or family.unattributed_log_errors for family in server.families) or server.log_errors:
            return False
        if not healthy(server.health_after) or server.exit_code != 0:
            return False
    return True


def healthy(health: Health | None) -> bool:
    return health is not None and health.ok


def schema_phase(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    options = f"--checks {CHECKS} --max-examples {args.max_examples} --request-timeout {args.request_timeout} "
    options += f"--workers 2 --max-time {int(args.time_limit)} --seed {args.seed} --generation-database none "
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{base_url}/openapi.json", "--url", base_url]
    command += (options + "--no-color --suppress-health-check all").split()
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
    summary, seconds = (
        [line for line in output.splitlines() if line.strip()][-40:],
        round(time.monotonic() - started, 1),
    )
    figures, failures = schema_figures(output), failure_section(output)
    run = {"command": " ".join(command), "exit_code": exit_code, "timed_out": timed_out, "seconds": seconds}
    return run | {"figures": figures, "failures": failures, "summary": summary}


def schema_figures(output: str) -> dict[str, str]:
    """The summary's figures: operations tested, test phases, test cases, failures by check."""

    def first(pattern: str) -> str:
        match = re.search(pattern, output, re.MULTILINE)
        return match.group(1).strip() if match else "?"

    phases = re.findall(r"^\s*(✅|❌|⏭|🚫)\s+(\w+)\s*$", output, re.MULTILINE)
    failures = re.findall(r"^\s*❌ (ST\d+ [^:\n]+: \d+)\s*$", output, re.MULTILINE)
    server_errors = re.search(r"ST101 Server error: (\d+)", output)
    tested, selected = first(r"^\s*Tested: (\d+)"), first(r"^\s*Selected: (\S+)")
    return {
        "operations": f"{tested} of {selected}",
        "phases": ", ".join(f"{name} {mark}" for mark, name in phases) or "?",
        "test_cases": first(r"^Test cases:\s*\n\s*(.+)$"),
        "server_errors": server_errors.group(1) if server_errors else "0",
        "failures": "; ".join(failures) or "none",
    }


def failure_section(output: str, most: int = 200) -> list[str]:
    """The FAILURES section (each failure with its curl reproduction), at most `most` lines."""
    lines = output.splitlines()
    start = next((index for index, line in enumerate(lines) if re.match(r"=+ FAILURES =+", line)), None)
    if start is None:
        return []
    end = next((index for index in range(start + 1, len(lines)) if re.match(r"=+ \w", lines[index])), len(lines))
    return lines[start + 1 : end][:most]


def health_text(health: Health | None) -> str:
    if health is None:
        return "not checked"
    if not health.alive:
        return f"**dead** ({health.detail})"
    image = f", image chat {health.image_chat_status}" if health.image_chat_status is not None else ""
    verdict = "ok" if health.ok else "**not ok**"
    return (
        f"{verdict}: /health {health.status}, running {health.running}, waiting {health.waiting}, "
        f"chat {health.chat_status}{image}" + (f" ({health.detail})" if health.detail else "")
    )


def print_report(servers: Sequence[FuzzedServer], args: argparse.Namespace, seconds: float) -> None:
    print("## Courier fuzz bench\n")
    print(f"- phases: {', '.join(args.phases)}; seed {args.seed}; request timeout {args.request_timeout:g} s")
    print(f"- {'PASS' if passed(servers) else 'FAIL'} after {seconds:g} s")
    for server in servers:
        print(f"- {server.name} server: `{server.command}`")
    print()
    for server in servers:
        if server.schema is not None:
            print_schema(server)
    if any(server.families for server in servers):
        print_hostile(servers, args)
    print_servers(servers)


def print_schema(server: FuzzedServer) -> None:
    schema = server.schema
    assert schema is not None
    figures = schema["figures"]
    print(f"### Phase 1: schema (schemathesis, {server.name} server)\n")
    rows = [
        f"operations | {figures['operations']} tested (phases: {figures['phases']})",
        f"test cases | {figures['test_cases']}",
        f"5xx (ST101 server errors) | {figures['server_errors']}",
        f"failures | {figures['failures']}",
        f"time | {schema['seconds']:g} s; exit code {schema['exit_code']}, timed out: {schema['timed_out']}",
        f"after | {health_text(server.schema_health)}",
    ]
    table("figure | value", rows)
    if schema["failures"]:
        print("Failures (schemathesis's words, with the curl to reproduce each):\n")
        print("```\n" + "\n".join(shorten(line, 2000) for line in schema["failures"]) + "\n```\n")


def family_row(run: FamilyRun) -> str:
    other = len(run.problems) - run.count("5xx") - run.count("timeout") - run.count("connection error")
    other += len([line for line in run.unattributed_log_errors if LOG_HEAD.match(line)])
    documented = f" (422 compaction_failed x{run.documented_failures}: documented)" if run.documented_failures else ""
    return (
        f"{run.server} | {run.family} | {run.selected} ({run.generated}) | {run.sent} | "
        f"{statuses_text(run.statuses)}{documented} | {run.count('5xx')} | {run.count('timeout')} | "
        f"{run.count('connection error')} | {other} | {len(run.surprises)} | {run.faults_counted} | "
        f"{health_text(run.health_after)}"
    )


def print_hostile(servers: Sequence[FuzzedServer], args: argparse.Namespace) -> None:
    print(f"### Phase 2: hostile (seed {args.seed}, at most {args.hostile_cases} cases per family)\n")
    headers = "server | family | cases (generated) | sent | statuses | 5xx | timeouts | connection errors"
    table(
        f"{headers} | other problems | surprises | faults | health after",
        (family_row(r) for s in servers for r in s.families),
    )
    print_answers("Problems", [answer for server in servers for run in server.families for answer in run.problems])
    for run in (run for server in servers for run in server.families if run.unattributed_log_errors):
        print(f"Errors in the {run.server} server's log during {run.family}, naming no request's trace:\n")
        print("```\n" + "\n".join(shorten(line, 400) for line in run.unattributed_log_errors[:80]) + "\n```\n")
    print_surprises([(run, answer) for server in servers for run in server.families for answer in run.surprises])


def print_answers(title: str, answers: Sequence[Answer]) -> None:
    print(f"#### {title}: {len(answers)}\n")
    for index, answer in enumerate(answers, 1):
        print(f"{index}. `{answer.case}`: {answer.method} {answer.path} -> **{answer.problem}** ({answer.seconds} s)")
        print(f"   - request ({answer.request_bytes} bytes): `{answer.request}`")
        print(f"   - response: `{answer.response}`")
        if answer.log:
            print("   - server log:\n\n```")
            print("\n".join(shorten(line, 400) for line in answer.log[-30:]))
            print("```")
    print()


def print_surprises(surprises: Sequence[tuple[FamilyRun, Answer]]) -> None:
    """Grouped by what surprised: the generator's expectation was wrong, or the server is lenient or strict."""
    print(f"#### Surprises (sound answers, not the expected kind): {len(surprises)}\n")
    by_kind: Counter[tuple[str, str, str]] = Counter()
    examples: dict[tuple[str, str, str], Answer] = {}
    for run, answer in surprises:
        kind = (f"{run.server}/{run.family}", answer.surprise or "", answer.code or "")
        by_kind[kind] += 1
        examples.setdefault(kind, answer)
    for kind, count in by_kind.most_common():
        example = examples[kind]
        code = f" `{kind[2]}`" if kind[2] else ""
        print(f"- {kind[0]}: {kind[1]}{code} x{count}, e.g. `{example.case}`: `{shorten(example.response, 240)}`")
    print()


def print_servers(servers: Sequence[FuzzedServer]) -> None:
    print("### Servers\n")
    rows = [
        f"{s.name} | {health_text(s.health_after)} | {s.exit_code} | {len(s.log_errors)} | {s.log_path or '-'}"
        for s in servers
    ]
    table("server | health at the end | exit code | ERROR lines in its log | log", rows)
    for server in servers:
        if server.log_errors:
            print(f"ERROR lines in the {server.name} server's log (first 20):\n\n```")
            print("\n".join(shorten(line, 400) for line in server.log_errors[:20]) + "\n```\n")


if __name__ == "__main__":
    sys.exit(main())
