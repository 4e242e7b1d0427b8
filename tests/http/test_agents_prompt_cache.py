"""The prompt cache under real agents' habits: their recorded requests replayed through a real server.

`tests/data/agents/` holds what Claude Code 2.1.197 and Codex 0.171 sent: `claude-code-2.1.197/` to a recording
server (tests/support/agent_recorder.py), `claude-code/` (three user turns with `--continue`, and a new conversation
in the same project) and `codex/` (`three-turns-*`: `codex exec` then `codex exec resume --last` twice, and
`another-session-01`) through tests/support/logging_proxy.py to a Courier. Replayed in order on the 64K-window tiny
model (tests/support/agent_model.py), each conversation's turns after the first must start from the whole previous
prompt. What the recordings show:

- Both agents resend the history unchanged and append to it, so consecutive turns diverge only where the previous
  reply begins (in a replay, this server's own reply differs from the recorded one; live, the idle warm-up covers
  it). The divergence report says so.
- Claude Code's `x-anthropic-billing-header` line, first in its system prompt, differs between conversations
  (2.1.197: `cc_version=2.1.197.<3 hex digits>` per conversation; later versions add a per-request `cch=`). Left
  out before rendering (the default), a new conversation in the same project reuses the ~19K tokens of system
  prompt and tools another one left; kept (`--no-prompt-cache-normalize`), 25 tokens.

Replayed with `stream: false` (the usage comes in one body) and, for Codex, without what Courier does not serve yet
(`logging_proxy.for_courier`). Each test starts from an empty cache. A later turn is also tokenized from the one
before (docs/prompt-cache.md, "Tokenizing only what is new"): the trace says how many of its tokens were taken,
and /metrics counts them.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.agent_model import build_agent_model
from tests.support.logging_proxy import for_courier
from tests.support.polling import attempts
from tests.support.server import RunningServer, running_server, serving

AGENTS = Path(__file__).resolve().parents[1] / "data" / "agents"
CLAUDE_CODE = AGENTS / "claude-code"
CODEX = AGENTS / "codex"
MODEL = "courier-model"  # the name both agents were pointed at
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def agent_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_model(smollm2_dir, tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agent-spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def normalizing(agent_model_dir: Path, cache_dir: Path, trace_file: Path) -> Iterator[RunningServer]:
    args = ["--model", str(agent_model_dir), "--cache-dir", str(cache_dir), "--served-model-name", f"{MODEL},claude-*"]
    args += ["--prompt-cache-disk-bytes", "0", "--trace-file", str(trace_file)]
    # Spans are written within 50 ms of ending (not the SDK's 5 s), so a test reads its own while the server runs.
    with running_server(args, env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as running:
        yield running
        assert running.stop() == 0


@pytest.fixture(scope="module")
def verbatim(agent_model_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    extra = ("--prompt-cache-disk-bytes", "0", "--no-prompt-cache-normalize")
    with serving(agent_model_dir, cache_dir, f"{MODEL},claude-*", *extra) as running:
        yield running


def recorded(path: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text())
    assert record["method"] == "POST"
    return record


def replay(server: RunningServer, record: dict[str, Any]) -> tuple[int, int]:
    """Send a recorded request; its (prompt tokens, cached tokens)."""
    body = {**for_courier(record["body"]), "stream": False}
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as http:
        response = http.post(record["path"], json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    if "cache_read_input_tokens" in usage:  # the Messages API
        cached = usage["cache_read_input_tokens"]
        return usage["input_tokens"] + usage["cache_creation_input_tokens"] + cached, cached
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


def turns(server: RunningServer, paths: list[Path]) -> list[tuple[int, int]]:
    return [replay(server, recorded(path)) for path in paths]


def reused_tokens(trace_file: Path, since: float, requests: int) -> list[int]:
    """`courier.tokenize.reused_tokens` of the renders of the `requests` admissions since `since` (seconds since
    the epoch), in order, once all are written."""
    for _ in attempts():
        spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()] if trace_file.exists() else []
        admissions = {span["context"]["span_id"] for span in spans if span["name"] == "ingress.AdmitGeneration"}
        renders = sorted(
            (span["start_time"], span["attributes"]["courier.tokenize.reused_tokens"])
            for span in spans
            if span["name"] == "token_counter.TokenizeChat"
            and span["parent_id"] in admissions
            and datetime.fromisoformat(span["start_time"]).timestamp() >= since
        )
        if len(renders) >= requests:
            assert len(renders) == requests, renders
            return [reused for _, reused in renders]
    raise AssertionError(f"{requests} admissions' renders never reached {trace_file}")


def divergences(server: RunningServer, since: float) -> list[dict[str, Any]]:
    """The divergences reported since `since` (seconds since the epoch), oldest first (a reset keeps the list)."""
    with server.http() as http:
        found: list[dict[str, Any]] = http.get("/v1/cache/stats").json()["snapshot_recent_divergences"]
    return [divergence for divergence in found[::-1] if divergence["at"] >= since]


@pytest.fixture(autouse=True)
def started(request: pytest.FixtureRequest) -> float:
    """Each test starts from empty caches, once the idle warm-ups of the test before have run (one landing after
    the reset would be a cached entry); returns when (to read only its own divergences)."""
    for name in ("normalizing", "verbatim"):
        if name in request.fixturenames:
            server: RunningServer = request.getfixturevalue(name)
            with server.http() as http:
                _until_idle(http)
                assert http.post("/v1/cache/reset").status_code == 200
    return time.time() - 0.001  # the server rounds the times it reports to the millisecond


def _until_idle(http: httpx.Client) -> None:
    """Polled (a request each), never slept."""
    for _ in attempts():
        stats = http.get("/v1/cache/stats").json()
        done = stats["snapshot_warmups_run"] + stats["snapshot_warmups_skipped"]
        if done == stats["snapshot_warmups_queued"] and stats["snapshot_warmups_pending"] == 0:
            return
    raise AssertionError(f"the idle warm-ups never finished: {stats}")


@pytest.mark.parametrize(
    "names",
    [
        # three user turns (-p, then --continue twice)
        ["claude-code/continue-02", "claude-code/continue-04", "claude-code/continue-06"],
        # thinking and a Bash call, then its result
        ["claude-code-2.1.197/tool-loop-02", "claude-code-2.1.197/tool-loop-03"],
    ],
    ids=["three-turns", "tool-loop"],
)
def test_claude_codes_later_turns_start_from_the_whole_previous_prompt(
    normalizing: RunningServer, trace_file: Path, names: list[str], started: float
) -> None:
    replayed = turns(normalizing, [AGENTS / f"{name}.json" for name in names])
    assert replayed[0][0] > 15_000  # its system prompt and 24 tools
    for (previous, _), (prompt, cached) in itertools.pairwise(replayed):
        assert previous <= cached < prompt
    _diverge_only_in_the_previous_reply(normalizing, replayed, started)
    _tokenized_from_the_previous_prompt(normalizing, trace_file, replayed, started)


def test_codexs_later_turns_start_from_the_whole_previous_prompt(
    normalizing: RunningServer, trace_file: Path, started: float
) -> None:
    replayed = turns(normalizing, [CODEX / f"three-turns-0{n}.json" for n in (1, 2, 3)])
    assert replayed[0][0] > 5_000  # its ~17,000-character developer message and tools
    for (previous, _), (prompt, cached) in itertools.pairwise(replayed):
        assert previous <= cached < prompt
    _diverge_only_in_the_previous_reply(normalizing, replayed, started)
    _tokenized_from_the_previous_prompt(normalizing, trace_file, replayed, started)
    # Another Codex session in the same directory: the same developer messages, then its own question.
    prompt, cached = replay(normalizing, recorded(CODEX / "another-session-01.json"))
    assert cached >= prompt - 20


def _tokenized_from_the_previous_prompt(
    server: RunningServer, trace_file: Path, replayed: list[tuple[int, int]], since: float
) -> None:
    """The first turn is tokenized whole (the reset before the test forgot every render); each later one takes the
    previous prompt's tokens up to the `<|im_start|>` of its generation prompt, where the recorded reply follows."""
    reused = reused_tokens(trace_file, since, len(replayed))
    assert reused[0] == 0
    for (previous, _), (prompt, _), taken in zip(replayed, replayed[1:], reused[1:], strict=False):
        assert previous - 8 <= taken < prompt, (previous, taken, prompt)
    with server.http() as http:
        metrics = http.get("/metrics").text
    figures = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("courier_tokenizer_")
    }
    assert figures["courier_tokenizer_reused_tokens_total"] >= sum(reused)  # counted since the server started
    assert figures["courier_tokenizer_kept_renders"] >= 1 and figures["courier_tokenizer_kept_bytes"] > 0


def _diverge_only_in_the_previous_reply(server: RunningServer, replayed: list[tuple[int, int]], since: float) -> None:
    """Each later turn's prompt left its conversation's cache only after the previous prompt: in the reply, which
    this server wrote otherwise than the recorded one."""
    later = {prompt for prompt, _ in replayed[1:]}  # (a first turn may miss what the test before left)
    found = [divergence for divergence in divergences(server, since) if divergence["prompt_tokens"] in later]
    assert [(d["diverged_at"], d["closest_same_session"]) for d in found] == [
        (cached, True) for _, cached in replayed[1:]
    ]
    assert all(d["before"].endswith("<|im_start|>assistant\n") for d in found)


def test_a_new_claude_code_conversation_reuses_the_system_prompt_another_left(
    normalizing: RunningServer, verbatim: RunningServer
) -> None:
    """Two conversations in one project: only the billing line and the first user message differ."""
    paths = [CLAUDE_CODE / "continue-02.json", CLAUDE_CODE / "new-conversation-02.json"]
    (_, _), (prompt, cached) = turns(normalizing, paths)
    assert cached > 0.9 * prompt  # all but the first user message (agent types, skills, the question)
    (_, _), (prompt, kept) = turns(verbatim, paths)
    assert kept < 40  # the chat template's start and the line up to `cc_version=2.1.197.`


def with_billing(record: dict[str, Any], cch: str) -> dict[str, Any]:
    """`record` as versions that add a per-request `cch=` to the billing line send it (NOTES.md): only that changes."""
    system = [dict(block) for block in record["body"]["system"]]
    assert system[0]["text"].startswith("x-anthropic-billing-header: ")
    system[0]["text"] = f"{system[0]['text']} cch={cch};"
    return {**record, "body": {**record["body"], "system": system}}


def test_a_billing_line_that_changes_every_request_busts_the_cache_only_when_kept(
    normalizing: RunningServer, verbatim: RunningServer, started: float
) -> None:
    first, second = recorded(CLAUDE_CODE / "continue-02.json"), recorded(CLAUDE_CODE / "continue-04.json")
    sent = [with_billing(first, "8e1f0"), with_billing(second, "2b9c4")]
    (previous, _), (_, cached) = [replay(normalizing, record) for record in sent]
    assert cached >= previous
    (_, _), (prompt, kept) = [replay(verbatim, record) for record in sent]
    assert kept < 64  # the chat template's start and the line up to `cch=`
    # The second turn says where it left its conversation's cache, and why (the first may have missed what the
    # test before left).
    (found,) = [divergence for divergence in divergences(verbatim, started) if divergence["prompt_tokens"] == prompt]
    assert (found["closest_same_session"], found["prompt_tokens"], found["matched_tokens"]) == (True, prompt, kept)
    assert found["before"].endswith("cc_entrypoint=sdk-cli; cch=")
    assert found["prompt"].startswith("2b9c4;") and found["cached"].startswith("8e1f0;")
