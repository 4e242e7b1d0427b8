"""Agent sessions replayed against Courier and mlx_lm.server: a recorded 10-turn Claude Code session (Anthropic's
Messages API) and a 10-turn Codex session (the Responses dialect), each turn's whole history sent again as the agents
send it, streamed; mlx_lm.server (and Courier, for comparison) given the same turns through chat completions.

Per turn: the prompt's tokens, the share the prompt cache served (Courier: `cache_read_input_tokens` /
`input_tokens_details.cached_tokens` / `prompt_tokens_details.cached_tokens`; mlx_lm.server: its
`prompt_tokens_details.cached_tokens`), and the time to the first output event. Each session is replayed
`--sessions` times, each a new session of the same agent in the same directory (a fresh cache session and its own
first question): the system prompt and tools may be served from the cache on turn 1, the conversation may not.

The model: a tiny random-weight llama with a 64K window and SmolLM2's tokenizer and template (tests/support/
agent_model.py), since Claude Code's first prompt (~23K tokens) is past SmolLM2's 8K window. It ends its replies
within a few tokens, so a turn's time is mostly its prefill. `--build` continues the recorded sessions to ten turns
(bench/agent_sessions.py) and writes them to bench/data/agents/.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import agent_sessions
from bench.agent_sessions import Dialect, Session
from bench.harness import cli
from bench.harness.models import cache_directory, prepare_4bit_dir
from bench.harness.report import environment, head, ms, percent, progress, table, write_json
from bench.harness.servers import COURIER, MLX_LM_F32, Launcher, ServerRecord, ServerSpec, openblas_missing
from bench.harness.stats import percentile, share
from courier.platform.blas import load_optimized_blas

SERVED_NAME = "agent"  # Courier's id for the agent model; Claude Code's `claude-*` names are aliases of it
COURIER_NAMES = f"{SERVED_NAME},claude-*"
MLX_LM = "mlx-lm"
ARMS = ("anthropic", "responses", "courier-chat", "mlx-lm-chat")
DEFAULT_SESSIONS = 5
CHAT_MAX_TOKENS = 256  # the model ends within a few tokens; a bound for the chat arms, which send no agent limit
GOAL_CACHED_SHARE = 0.95
REQUEST_TIMEOUT_S = 600.0
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One streamed turn: prompt tokens, those the cache served (None: not reported), time to first output event
    (the end of the stream when the reply has none)."""

    server: str
    arm: str
    dialect: str
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    output_events: int


@dataclass(slots=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    turns: list[Turn] = field(default_factory=list)
    servers: list[ServerRecord] = field(default_factory=list)


def sse_events(response: httpx.Response) -> Iterator[tuple[float, dict[str, Any]]]:
    """(arrival time, data) of each server-sent event carrying JSON."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield time.perf_counter(), json.loads(data)


def timed(http: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str], read: Reader) -> Timing:
    sent = time.perf_counter()
    with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
        timing = read(sse_events(response))
    return Timing(timing.first - sent, timing.prompt_tokens, timing.cached_tokens, timing.output_events)


@dataclass(frozen=True, slots=True)
class Timing:
    first: float  # an arrival time while reading; the TTFT once `timed` returns it
    prompt_tokens: int
    cached_tokens: int | None
    output_events: int


Reader = Callable[[Iterator[tuple[float, dict[str, Any]]]], Timing]


def read_anthropic(events: Iterator[tuple[float, dict[str, Any]]]) -> Timing:
    first: float | None = None
    deltas, last = 0, 0.0
    usage: dict[str, Any] = {}
    for last, event in events:
        if event["type"] == "content_block_delta":
            deltas += 1
            first = first or last
        elif event["type"] == "message_delta":
            usage = event["usage"]
    read = usage.get("cache_read_input_tokens") or 0
    prompt = usage.get("input_tokens", 0) + read + (usage.get("cache_creation_input_tokens") or 0)
    return Timing(first or last, prompt, read, deltas)


def read_responses(events: Iterator[tuple[float, dict[str, Any]]]) -> Timing:
    first: float | None = None
    deltas, last = 0, 0.0
    usage: dict[str, Any] = {}
    for last, event in events:
        if event["type"].endswith(".delta"):
            deltas += 1
            first = first or last
        elif event["type"] in ("response.completed", "response.incomplete"):
            usage = event["response"]["usage"]
    details = usage.get("input_tokens_details") or {}
    return Timing(first or last, usage.get("input_tokens", 0), details.get("cached_tokens"), deltas)


def read_chat(events: Iterator[tuple[float, dict[str, Any]]]) -> Timing:
    first: float | None = None
    deltas, last = 0, 0.0
    usage: dict[str, Any] = {}
    for last, chunk in events:
        if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
            deltas += 1
            first = first or last
        usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Timing(first or last, usage.get("prompt_tokens", 0), details.get("cached_tokens"), deltas)


def replay(
    server: str, base_url: str, model: str, arms: Sequence[str], *, sessions: int, tool_s: float = 0.0
) -> list[Turn]:
    """Every session of each arm, turn by turn, on the server at `base_url`; `tool_s` between a reply and the next
    turn, standing in for the tool the agent runs (0: the next turn at once, the worst case for a warm-up)."""
    turns: list[Turn] = []
    loaded = {dialect: agent_sessions.load(dialect) for dialect in Dialect}
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        for arm in arms:
            dialects = [Dialect(arm)] if arm in ("anthropic", "responses") else list(Dialect)
            for dialect in dialects:
                session = loaded[dialect]
                for index in range(sessions):
                    # The chat arms share a label, so Courier's and mlx_lm.server's prompts are the same tokens.
                    label = f"{'chat' if arm.endswith('chat') else arm} session {index + 1}"
                    progress(f"{server}: {arm} ({dialect.value}) session {index + 1}/{sessions}")
                    for turn in range(1, session.turns + 1):
                        if turn > 1 and tool_s > 0:
                            time.sleep(tool_s)  # the workload's pause (the agent running its tool), not a wait
                        timing = _turn(http, session, arm, turn, label=label, model=model)
                        turns.append(
                            Turn(
                                server=server,
                                arm=arm,
                                dialect=dialect.value,
                                session=index + 1,
                                turn=turn,
                                prompt_tokens=timing.prompt_tokens,
                                cached_tokens=timing.cached_tokens,
                                ttft_s=timing.first,
                                output_events=timing.output_events,
                            )
                        )
    return turns


def _turn(http: httpx.Client, session: Session, arm: str, turn: int, *, label: str, model: str) -> Timing:
    if arm == "anthropic":
        body = session.body(turn, label=label)
        return timed(http, session.shape.path, body, ANTHROPIC_HEADERS, read_anthropic)
    if arm == "responses":
        body = session.body(turn, label=label, model=model)
        return timed(http, session.shape.path, body, {}, read_responses)
    chat = {
        "model": model,
        "messages": agent_sessions.chat_turn(session, turn, label),
        "max_tokens": CHAT_MAX_TOKENS,
        "temperature": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": label,  # Courier's cache session (mlx_lm.server ignores it)
    }
    return timed(http, "/v1/chat/completions", chat, {}, read_chat)


def build_sessions(launcher: Launcher, spec: ServerSpec) -> int:
    def build(server: Any) -> None:
        for dialect in Dialect:
            session = agent_sessions.build(dialect, server.base_url, SERVED_NAME)
            progress(f"{dialect.value}: {session.turns} turns written to {agent_sessions.save(session)}")

    record, _ = launcher.run(spec, build, log_name="build")
    return 1 if record.error else 0


def print_report(report: Report) -> None:
    head("Agent sessions: Courier and mlx_lm.server", report.environment, report.settings)
    groups = sorted({(turn.server, turn.arm, turn.dialect) for turn in report.turns}, key=_order)
    rows = []
    for server, arm, dialect in groups:
        mine = [turn for turn in report.turns if (turn.server, turn.arm, turn.dialect) == (server, arm, dialect)]
        later = [turn for turn in mine if turn.turn >= 2]
        cached = _cached_share(later)
        first = [turn.ttft_s for turn in mine if turn.turn == 1]
        rows.append(
            f"{server} | {arm} | {dialect} | {max(turn.prompt_tokens for turn in mine)} | {percent(cached)} "
            f"| {ms(percentile(first, 0.5))} | {ms(percentile([t.ttft_s for t in later], 0.5))} "
            f"| {ms(percentile([t.ttft_s for t in later], 0.95))}"
        )
    table(
        "server | arm | session | last prompt (tokens) | turns 2+ cached | TTFT turn 1 p50 ms | TTFT turns 2+ p50 ms "
        "| TTFT turns 2+ p95 ms",
        rows,
    )
    for server, arm, dialect in groups:
        mine = [turn for turn in report.turns if (turn.server, turn.arm, turn.dialect) == (server, arm, dialect)]
        print(f"**{server}, {arm} ({dialect} session)**, per turn over {len({t.session for t in mine})} sessions:\n")
        per_turn = []
        for number in sorted({turn.turn for turn in mine}):
            these = [turn for turn in mine if turn.turn == number]
            ttfts = [turn.ttft_s for turn in these]
            per_turn.append(
                f"{number} | {these[0].prompt_tokens} | {percent(_cached_share(these))} | {ms(percentile(ttfts, 0.5))} "
                f"| {ms(percentile(ttfts, 0.95))}"
            )
        table("turn | prompt tokens | cached | TTFT p50 ms | TTFT p95 ms", per_turn)
    print("Servers:\n")
    for record in report.servers:
        print(record.line())
    print()


def _cached_share(turns: Sequence[Turn]) -> float | None:
    if not turns or any(turn.cached_tokens is None for turn in turns):
        return None
    return share(sum(turn.cached_tokens or 0 for turn in turns), sum(turn.prompt_tokens for turn in turns))


def _order(group: tuple[str, str, str]) -> tuple[int, int, str]:
    server, arm, dialect = group
    return (0 if server == COURIER else 1, ARMS.index(arm), dialect)


def parse_args(argv: Sequence[str] | None) -> Any:
    parser = cli.parser(__doc__)
    parser.add_argument("--sessions", type=cli.positive_int, default=DEFAULT_SESSIONS, help="replays of each session")
    parser.add_argument(
        "--arms",
        type=cli.names(ARMS),
        default=list(ARMS),
        help="what to replay: anthropic, responses (Courier), courier-chat and mlx-lm-chat (both sessions as chat)",
    )
    parser.add_argument(
        "--tool-seconds",
        type=float,
        default=0.0,
        help="pause between a reply and the next turn, standing in for the agent's tool run (default 0: at once)",
    )
    parser.add_argument("--build", action="store_true", help="continue the recorded sessions to ten turns and stop")
    cli.add_results(parser, openblas=MLX_LM_F32)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if openblas_missing(args.openblas, "mlx-lm-chat" in args.arms, "leave out mlx-lm-chat"):
        return 2
    blas = load_optimized_blas()  # before MLX is imported
    from bench.harness.support import build_agent_model

    settings = {
        "sessions": args.sessions,
        "arms": args.arms,
        "turns": agent_sessions.TURNS,
        "tool_seconds": args.tool_seconds,
    }
    report = Report(environment=environment(blas, "anthropic"), settings=settings)
    with cache_directory(args.cache_dir) as cache_dir:
        launcher = Launcher(
            bench="agents", cache_dir=cache_dir, log_dir=cache_dir / "bench-logs", openblas=args.openblas
        )
        progress("building the agent model (SmolLM2's tokenizer)")
        model_dir = build_agent_model(prepare_4bit_dir(cache_dir), cache_dir / "bench-models" / "agent")
        courier = ServerSpec(name=COURIER, model_dir=model_dir, served_name=COURIER_NAMES)
        if args.build:
            return build_sessions(launcher, courier)
        courier_arms = [arm for arm in args.arms if arm != "mlx-lm-chat"]
        if courier_arms:
            _, turns = launcher.run(
                courier,
                lambda server: replay(
                    COURIER,
                    server.base_url,
                    SERVED_NAME,
                    courier_arms,
                    sessions=args.sessions,
                    tool_s=args.tool_seconds,
                ),
            )
            report.turns += turns or []
        if "mlx-lm-chat" in args.arms:
            mlx = ServerSpec(name=MLX_LM, kind=MLX_LM_F32, model_dir=model_dir, flags=("--log-level", "WARNING"))
            _, turns = launcher.run(
                mlx,
                lambda server: replay(
                    MLX_LM,
                    server.base_url,
                    mlx.model,
                    ["mlx-lm-chat"],
                    sessions=args.sessions,
                    tool_s=args.tool_seconds,
                ),
            )
            report.turns += turns or []
        report.servers = launcher.records
    print_report(report)
    write_json(report, args.json)
    return 1 if any(record.error for record in report.servers) else 0


if __name__ == "__main__":
    sys.exit(main())
