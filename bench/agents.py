"""Agent sessions replayed against Courier and mlx_lm.server (issue 31): a recorded Claude Code session (Messages
API) and a Codex session (Responses), ten turns each, every turn's whole history sent again and streamed;
mlx_lm.server (and Courier, for comparison) given the same turns as chat completions. Per turn: prompt tokens, the
share the prompt cache served, the time to the first output event. `--build` continues the recorded sessions to ten
turns (bench/agent_sessions.py)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import httpx

from bench import agent_sessions
from bench.agent_sessions import Dialect, Session
from bench.harness import cli
from bench.harness.models import prepare_4bit_dir
from bench.harness.report import environment, head, ms, percent, progress, table, write_json
from bench.harness.runs import launching
from bench.harness.servers import COURIER, MLX_LM_F32, Launcher, Server, ServerRecord, ServerSpec, openblas_missing
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


@dataclass(frozen=True, slots=True)
class Timing:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None
    output_events: int


@dataclass(frozen=True, slots=True)
class StreamKind:
    """How a stream of one API says it wrote output, and where it puts its usage."""

    is_output: Callable[[dict[str, Any]], bool]
    usage: Callable[[dict[str, Any]], dict[str, Any] | None]  # the usage an event carries, if any
    tokens: Callable[[dict[str, Any]], tuple[int, int | None]]  # (prompt tokens, cached tokens) from the usage


def anthropic_tokens(usage: dict[str, Any]) -> tuple[int, int | None]:
    read = usage.get("cache_read_input_tokens") or 0
    return usage.get("input_tokens", 0) + read + (usage.get("cache_creation_input_tokens") or 0), read


STREAMS = {
    "anthropic": StreamKind(
        lambda event: event["type"] == "content_block_delta",
        lambda event: event["usage"] if event["type"] == "message_delta" else None,
        anthropic_tokens,
    ),
    "responses": StreamKind(
        lambda event: event["type"].endswith(".delta"),
        lambda e: e["response"]["usage"] if e["type"] in ("response.completed", "response.incomplete") else None,
        lambda u: (u.get("input_tokens", 0), (u.get("input_tokens_details") or {}).get("cached_tokens")),
    ),
    "chat": StreamKind(
        lambda chunk: any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])),
        lambda chunk: chunk.get("usage"),
        lambda u: (u.get("prompt_tokens", 0), (u.get("prompt_tokens_details") or {}).get("cached_tokens")),
    ),
}


def timed(http: httpx.Client, path: str, body: dict[str, Any], headers: dict[str, str], stream: StreamKind) -> Timing:
    """POST `body` and read its server-sent events: TTFT to the first output event (the end of the stream when the
    reply has none), the usage's prompt and cached tokens, the output events."""
    sent, first, last, events = time.perf_counter(), None, 0.0, 0
    usage: dict[str, Any] = {}
    with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            last, event = time.perf_counter(), json.loads(data)
            if stream.is_output(event):
                events, first = events + 1, first or last
            usage = stream.usage(event) or usage
    return Timing((first or last) - sent, *stream.tokens(usage), events)


def replay(on: Server, model: str, arms: Sequence[str], *, sessions: int, tool_s: float = 0.0) -> list[Turn]:
    """Every session of each arm, turn by turn, on the server `on`; `tool_s` between a reply and the next turn,
    standing in for the tool the agent runs (0: the next turn at once, the worst case for a warm-up)."""
    turns: list[Turn] = []
    loaded = {dialect: agent_sessions.load(dialect) for dialect in Dialect}
    server = on.spec.name
    with httpx.Client(base_url=on.base_url, timeout=REQUEST_TIMEOUT_S) as http:
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
                        t = _turn(http, session, arm, turn, label=label, model=model)
                        place: dict[str, Any] = {
                            "server": server,
                            "arm": arm,
                            "dialect": dialect.value,
                            "session": index + 1,
                            "turn": turn,
                        }
                        turns.append(Turn(**place, **asdict(t)))
    return turns


def _turn(http: httpx.Client, session: Session, arm: str, turn: int, *, label: str, model: str) -> Timing:
    if arm == "anthropic":
        body = session.body(turn, label=label)
        return timed(http, session.shape.path, body, ANTHROPIC_HEADERS, STREAMS["anthropic"])
    if arm == "responses":
        body = session.body(turn, label=label, model=model)
        return timed(http, session.shape.path, body, {}, STREAMS["responses"])
    messages = agent_sessions.chat_turn(session, turn, label)
    chat = {"model": model, "messages": messages, "max_tokens": CHAT_MAX_TOKENS, "temperature": 1.0, "stream": True}
    chat |= {"stream_options": {"include_usage": True}, "user": label}  # user: Courier's cache session
    return timed(http, "/v1/chat/completions", chat, {}, STREAMS["chat"])


def build_sessions(launcher: Launcher, spec: ServerSpec) -> int:
    def build(server: Any) -> None:
        for dialect in Dialect:
            session = agent_sessions.build(dialect, server.base_url, SERVED_NAME)
            progress(f"{dialect.value}: {session.turns} turns written to {agent_sessions.save(session)}")

    record, _ = launcher.run(spec, build, log_name="build")
    return 1 if record.error else 0


def print_report(report: Report) -> None:
    head("Agent sessions: Courier and mlx_lm.server", report.environment, report.settings)
    groups: dict[tuple[str, str, str], list[Turn]] = {}
    for turn in sorted(report.turns, key=lambda t: (t.server != COURIER, ARMS.index(t.arm), t.dialect)):
        groups.setdefault((turn.server, turn.arm, turn.dialect), []).append(turn)
    rows = []
    for (server, arm, dialect), mine in groups.items():
        later, first = [t for t in mine if t.turn >= 2], [t for t in mine if t.turn == 1]
        prompt, cached = max(t.prompt_tokens for t in mine), percent(_cached_share(later))
        ttfts = f"{ttft(first, 0.5)} | {ttft(later, 0.5)} | {ttft(later, 0.95)}"
        rows.append(f"{server} | {arm} | {dialect} | {prompt} | {cached} | {ttfts}")
    headers = "server | arm | session | last prompt (tokens) | turns 2+ cached | TTFT turn 1 p50 ms"
    table(f"{headers} | TTFT turns 2+ p50 ms | TTFT turns 2+ p95 ms", rows)
    for (server, arm, dialect), mine in groups.items():
        print(f"**{server}, {arm} ({dialect} session)**, per turn over {len({t.session for t in mine})} sessions:\n")
        per_turn = []
        for number in sorted({turn.turn for turn in mine}):
            these = [turn for turn in mine if turn.turn == number]
            cached = percent(_cached_share(these))
            per_turn.append(
                f"{number} | {these[0].prompt_tokens} | {cached} | {ttft(these, 0.5)} | {ttft(these, 0.95)}"
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


def ttft(turns: Sequence[Turn], fraction: float) -> str:
    return ms(percentile([turn.ttft_s for turn in turns], fraction))


def parse_args(argv: Sequence[str] | None) -> Any:
    parser = cli.parser(__doc__)
    parser.add_argument("--sessions", type=cli.positive_int, default=DEFAULT_SESSIONS, help="replays of each session")
    arms = "what to replay: anthropic, responses (Courier), courier-chat and mlx-lm-chat (both sessions as chat)"
    parser.add_argument("--arms", type=cli.names(ARMS), default=list(ARMS), help=arms)
    pause = "pause between a reply and the next turn, standing in for the agent's tool run (default 0: at once)"
    parser.add_argument("--tool-seconds", type=float, default=0.0, help=pause)
    parser.add_argument("--build", action="store_true", help="continue the recorded sessions to ten turns and stop")
    cli.add_results(parser, openblas=MLX_LM_F32)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if openblas_missing(args.openblas, "mlx-lm-chat" in args.arms, "leave out mlx-lm-chat"):
        return 2
    blas = load_optimized_blas()  # before MLX is imported
    from bench.harness.support import build_agent_model

    settings = {"sessions": args.sessions, "arms": args.arms, "turns": agent_sessions.TURNS}
    settings["tool_seconds"] = args.tool_seconds
    report = Report(environment=environment(blas, "anthropic"), settings=settings)
    with launching("agents", args) as launcher:
        progress("building the agent model (SmolLM2's tokenizer)")
        cache_dir = launcher.cache_dir
        model_dir = build_agent_model(prepare_4bit_dir(cache_dir), cache_dir / "bench-models" / "agent")
        courier = ServerSpec(name=COURIER, model_dir=model_dir, served_name=COURIER_NAMES)
        if args.build:
            return build_sessions(launcher, courier)
        mlx = ServerSpec(name=MLX_LM, kind=MLX_LM_F32, model_dir=model_dir, flags=("--log-level", "WARNING"))
        courier_arms = [arm for arm in args.arms if arm != "mlx-lm-chat"]
        mlx_arms = [arm for arm in args.arms if arm == "mlx-lm-chat"]
        for spec, model, arms in ((courier, SERVED_NAME, courier_arms), (mlx, mlx.model, mlx_arms)):
            if arms:
                run = partial(replay, model=model, arms=arms, sessions=args.sessions, tool_s=args.tool_seconds)
                report.turns += launcher.run(spec, run)[1] or []
        report.servers = launcher.records
    print_report(report)
    write_json(report, args.json)
    return 1 if any(record.error for record in report.servers) else 0


if __name__ == "__main__":
    sys.exit(main())
