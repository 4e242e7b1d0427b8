"""Claude Code against Courier: its recorded requests replayed, and the real `claude` binary run once.

`tests/data/agents/claude-code-<version>/` holds what Claude Code sent to a recording server
(`tests/support/agent_recorder.py`): `HEAD /`, a first turn of ~23K tokens with 24 tools, `max_tokens` 64,000,
`thinking: adaptive`, `context_management`, `output_config`, cache_control on system blocks, a mid-conversation
system message; a turn sending back thinking, a tool_use and its tool_result; a title request with a JSON schema;
and a gateway set-up's (`ANTHROPIC_AUTH_TOKEN` as Bearer, `ANTHROPIC_MODEL`). Each is replayed with its own headers
and must be answered in the right shape. Then `claude -p ... --max-turns 1` runs against the server and must exit 0.
`scripts/dev.sh test` installs the binary into .npm-agents/ where npm is found; without it that test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.anthropic.sse import check_order, read_events
from tests.support.agent_recorder import API_KEY, QUIET
from tests.support.npm_agents import agent_binary
from tests.support.server import RunningServer

ROOT = Path(__file__).resolve().parents[3]
RECORDED = sorted((ROOT / "tests" / "data" / "agents").glob("claude-code-*/*.json"))
# Headers that describe the recorded connection, not the request: httpx sets its own.
CONNECTION_HEADERS = {"host", "content-length", "connection", "accept-encoding"}
RUN_TIMEOUT_S = 50


def _recorded(path: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text())
    return record


@pytest.mark.parametrize("path", RECORDED, ids=[f"{path.parent.name}/{path.stem}" for path in RECORDED])
def test_each_recorded_request_is_answered_in_its_shape(server: RunningServer, path: Path) -> None:
    record = _recorded(path)
    headers = {name: value for name, value in record["headers"].items() if name.lower() not in CONNECTION_HEADERS}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        if record["method"] == "HEAD":
            assert http.head(record["path"], headers=headers).status_code < 500  # a probe: any answer will do
            return
        body = record["body"]
        assert record["method"] == "POST" and record["path"].startswith("/v1/messages")
        with http.stream("POST", record["path"], json=body, headers=headers) as response:
            assert response.status_code == 200, response.read()
            events = check_order(read_events(response))
    started, (_, delta) = events[0][1]["message"], events[-2]
    assert started["model"] == body["model"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    blocks = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert all(block["type"] in ("text", "tool_use") for block in blocks)  # the model does not think in tags
    if "format" in body.get("output_config", {}) and delta["delta"]["stop_reason"] == "end_turn":
        text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
        assert set(json.loads(text)) == {"title"}  # the title request's JSON schema held


def test_claude_code_runs_against_the_server(server: RunningServer, tmp_path: Path) -> None:
    claude = agent_binary("claude", "@anthropic-ai/claude-code")
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path / "home"),
        "ANTHROPIC_BASE_URL": server.base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        **QUIET,
    }
    completed_before = _completed(server)
    run = subprocess.run(
        [str(claude), "-p", "Say hello in one word.", "--max-turns", "1"],
        check=False,
        cwd=tmp_path / "work",
        env=environment,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, f"stdout: {run.stdout}\nstderr: {run.stderr}"
    assert _completed(server) > completed_before  # it was answered here, not somewhere else


def _completed(server: RunningServer) -> int:
    health = httpx.get(f"{server.base_url}/health").json()
    return int(health["scheduler"]["completed"])
