"""Ten-turn agent sessions for bench/agents.py: what each turn sends, in its own dialect (a session file in
bench/data/agents/ holds the first body and what each later turn appends to its history) and as chat completions.
`build` continues the shorter recorded sessions of tests/data/agents against a running Courier; how: docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import httpx

DATA_DIR = Path(__file__).resolve().parent / "data" / "agents"
RECORDED_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "agents"
TURNS = 10
LISTING_LINES = 12
BUILD_TIMEOUT_S = 600.0


class Dialect(Enum):
    ANTHROPIC = "anthropic"
    RESPONSES = "responses"


@dataclass(frozen=True, slots=True)
class DialectShape:
    """Where a dialect's history lives in its body, its route, its recorded turns and the tool its sessions call."""

    history_key: str
    path: str
    recorded: tuple[str, ...]
    tool: str
    file_name: str


SHAPES = {
    Dialect.ANTHROPIC: DialectShape(
        history_key="messages",
        path="/v1/messages?beta=true",
        recorded=("claude-code-2.1.197/tool-loop-02.json", "claude-code-2.1.197/tool-loop-03.json"),
        tool="Bash",
        file_name="claude-code-10.json",
    ),
    Dialect.RESPONSES: DialectShape(
        history_key="input",
        path="/v1/responses",
        recorded=("codex/three-turns-01.json", "codex/three-turns-02.json", "codex/three-turns-03.json"),
        tool="exec_command",
        file_name="codex-10.json",
    ),
}


@dataclass(frozen=True, slots=True)
class Session:
    """A dialect's first body and the appendices of turns 2..N (`appendices[i]` is added for turn i + 2)."""

    dialect: Dialect
    first: dict[str, Any]
    appendices: list[list[dict[str, Any]]]
    built_from: list[str]

    @property
    def shape(self) -> DialectShape:
        return SHAPES[self.dialect]

    @property
    def turns(self) -> int:
        return len(self.appendices) + 1

    def body(self, turn: int, *, label: str = "", model: str | None = None) -> dict[str, Any]:
        """Turn `turn` (from 1) as the agent sends it; `label` makes the session its own (its cache session and its
        first question), as a new session of the same agent in the same directory is; `model` renames the model."""
        body = copy.deepcopy(self.first)
        history: list[dict[str, Any]] = body[self.shape.history_key]
        for appendix in self.appendices[: turn - 1]:
            history.extend(copy.deepcopy(appendix))
        if self.dialect is Dialect.ANTHROPIC:  # Claude Code's one breakpoint moves to the newest block each turn
            body[self.shape.history_key] = history = _without_cache_control(history)
            last = history[-1]["content"]
            if isinstance(last, list) and last:
                last[-1]["cache_control"] = {"type": "ephemeral"}
        if model is not None:
            body["model"] = model
        if label:
            _label(self.dialect, body, label)
        return body

    def to_json(self) -> dict[str, Any]:
        built = {"dialect": self.dialect.value, "built_from": self.built_from}
        return built | {"first": self.first, "appendices": self.appendices}


def load(dialect: Dialect, directory: Path = DATA_DIR) -> Session:
    data = json.loads((directory / SHAPES[dialect].file_name).read_text())
    return Session(Dialect(data["dialect"]), data["first"], data["appendices"], data["built_from"])


def save(session: Session, directory: Path = DATA_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / session.shape.file_name
    path.write_text(json.dumps(session.to_json(), indent=1, ensure_ascii=False) + "\n")
    return path


def recorded(dialect: Dialect) -> Session:
    """The recorded session: its first body, and each later recorded turn's growth of the history."""
    shape = SHAPES[dialect]
    bodies = [json.loads((RECORDED_DIR / name).read_text())["body"] for name in shape.recorded]
    appendices = []
    for before, after in itertools.pairwise(bodies):
        earlier, later = (_without_cache_control(body[shape.history_key]) for body in (before, after))
        if later[: len(earlier)] != earlier:
            raise ValueError(f"{shape.recorded}: a recorded turn does not extend the one before it")
        appendices.append(later[len(earlier) :])
    return Session(dialect, bodies[0], appendices, [f"tests/data/agents/{name}" for name in shape.recorded])


def build(dialect: Dialect, base_url: str, model: str) -> Session:
    """The recorded session continued to TURNS turns against the Courier at `base_url` serving `model`."""
    session = recorded(dialect)
    with httpx.Client(base_url=base_url, timeout=BUILD_TIMEOUT_S) as http:
        while session.turns < TURNS:
            turn = session.turns
            body = session.body(turn, model=model if dialect is Dialect.RESPONSES else None)
            anthropic = dialect is Dialect.ANTHROPIC
            body["stream"], body["tool_choice"] = (
                False,
                {"type": "tool" if anthropic else "function", "name": session.shape.tool},
            )
            reply = _post(http, session.shape.path, body)
            session.appendices.append((_anthropic_appendix if anthropic else _responses_appendix)(reply, turn))
    return session


def chat_turn(session: Session, turn: int, label: str) -> list[dict[str, Any]]:
    """Turn `turn` as chat messages of text (tools described in the system message, calls and results as text)."""
    from courier.conversation.chat_render import chat_messages, chat_tools
    from courier.core.tools.generic import render
    from courier.http.anthropic.request import parse_messages_request
    from courier.http.responses.request import parse_responses_request
    from courier.messages.ingress import ChatPrompt

    body = session.body(turn, label=label)
    messages: list[Mapping[str, Any]]
    tools: list[Mapping[str, Any]]
    if session.dialect is Dialect.ANTHROPIC:
        prompt = parse_messages_request(body).generation.prompt
        assert isinstance(prompt, ChatPrompt)
        messages, tools = list(prompt.messages), list(prompt.tools or ())
    else:
        request = parse_responses_request(body)
        messages = list(chat_messages(request.instructions, request.input_items))
        tools = list(chat_tools(request.offered_tools or ()))
    return render(messages, tools)


def _without_cache_control(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history with every message block's `cache_control` taken out (where Claude Code puts its breakpoint
    changes from turn to turn; nothing else does)."""
    return [
        {
            **message,
            "content": [{k: v for k, v in block.items() if k != "cache_control"} for block in message["content"]]
            if isinstance(message.get("content"), list)
            else message.get("content"),
        }
        for message in history
    ]


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = http.post(path, json=body, headers={"anthropic-version": "2023-06-01"})
    if reply.status_code != 200:
        raise RuntimeError(f"POST {path}: {reply.status_code} {reply.text[:500]}")
    answer: dict[str, Any] = reply.json()
    return answer


def _anthropic_appendix(reply: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The reply as Claude Code sends it back (its blocks as they came), then a result for each call."""
    calls = [block for block in reply["content"] if block["type"] == "tool_use"]
    if not calls:
        raise RuntimeError(f"turn {turn}: the forced call did not come: {reply}")
    results = []
    for call in calls:
        listing = _listing(turn, str(call["input"].get("command", "")))
        results.append({"type": "tool_result", "tool_use_id": call["id"], "content": listing, "is_error": False})
    return [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": results}]


def _responses_appendix(reply: dict[str, Any], turn: int) -> list[dict[str, Any]]:
    """The reply's items as Codex sends them back, then a `function_call_output` for each call."""
    items = [item for item in reply["output"] if item["type"] in ("message", "reasoning", "function_call")]
    calls = [item for item in items if item["type"] == "function_call"]
    if not calls:
        raise RuntimeError(f"turn {turn}: the forced call did not come: {reply}")
    outputs = []
    for call in calls:
        try:
            command = str(json.loads(call["arguments"]).get("cmd", ""))
        except (ValueError, AttributeError):
            command = call["arguments"]
        outputs.append({"type": "function_call_output", "call_id": call["call_id"], "output": _listing(turn, command)})
    return [*items, *outputs]


def _listing(turn: int, command: str) -> str:
    """A made-up command output of about 150 tokens (nothing is run)."""
    lines = [f"$ {command[:80]}"]
    lines += [f"src/agent/module_{turn}_{index}.py  {40 * index + turn} lines  ok" for index in range(LISTING_LINES)]
    return "\n".join([*lines, "exit code 0"])


def _label(dialect: Dialect, body: dict[str, Any], label: str) -> None:
    """A session of its own: a fresh cache session, and `label` after the first question."""
    if dialect is Dialect.ANTHROPIC:
        user_id = json.loads(body["metadata"]["user_id"])
        user_id["session_id"] = str(uuid.uuid5(uuid.NAMESPACE_URL, label))
        body["metadata"]["user_id"] = json.dumps(user_id, separators=(",", ":"))
        first = body["messages"][0]["content"][-1]
    else:
        body["prompt_cache_key"] = str(uuid.uuid5(uuid.NAMESPACE_URL, label))
        first = next(item for item in body["input"] if item.get("role") == "user" and "<environment" not in str(item))
        first = first["content"][-1]
    first["text"] = f"{first['text']} ({label})"
