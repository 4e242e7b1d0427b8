"""Codex CLI against Courier: its recorded requests replayed, and the real `codex exec` binary run.

`tests/data/agents/codex/dialect-*.json` hold what Codex 0.171 sent through a logging proxy in front of
Courier (`tests/support/codex_recorder.py`): a first turn (function tools, a `namespace` group, `web_search`,
`reasoning.summary`, sealed reasoning asked for with `store: false`, `prompt_cache_key`, a ~17,000-character
developer message), a turn sending back a `get_goal` call and its output, one sending back a namespaced
`close_agent` call, and a remote compaction (v2: the input ends with `compaction_trigger`). Each is replayed with its
own headers and answered in the right shape. Then `codex exec` runs against the server, over HTTP and over the
Responses WebSocket, and must exit 0. The model is the tiny 64K-window llama of tests/support/agent_model.py (Codex's
first prompt is ~9K tokens); `scripts/dev.sh test` installs Codex into .npm-agents/ where npm is found, and the
runs are skipped without it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.support.agent_model import build_agent_model
from tests.support.codex_recorder import API_KEY, MODEL, PROVIDER, codex_environment, provider_config
from tests.support.npm_agents import agent_binary
from tests.support.server import RunningServer, serving

ROOT = Path(__file__).resolve().parents[2]
RECORDED = sorted((ROOT / "tests" / "data" / "agents" / "codex").glob("dialect-*.json"))
# Headers that describe the recorded connection, not the request: httpx sets its own.
CONNECTION_HEADERS = {"host", "content-length", "connection", "accept-encoding"}
RUN_TIMEOUT_S = 50
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_agent_model(smollm2_dir, tmp_path_factory.mktemp("agent-model"))
    with serving(model_dir, cache_dir, MODEL, "--api-key", API_KEY) as running:
        yield running


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """A stream's events, checked against their `event:` lines and numbered from 0 in order."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            event = orjson.loads(line[len("data: ") :])
            assert event["type"] == name
            events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


@pytest.mark.parametrize("path", RECORDED, ids=[f"{path.parent.name}/{path.stem}" for path in RECORDED])
def test_each_recorded_request_is_answered_in_its_shape(server: RunningServer, path: Path) -> None:
    record = json.loads(path.read_text())
    body = record["body"]
    headers = {name: value for name, value in record["headers"].items() if name.lower() not in CONNECTION_HEADERS}
    assert (record["method"], record["path"], body["stream"]) == ("POST", "/v1/responses", True)
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as http,
        http.stream("POST", record["path"], json=body, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        events = _events(response)
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in TERMINAL and not any(kind in TERMINAL for kind in kinds[:-1])
    final = events[-1]["response"]
    assert (final["model"], final["store"], final["reasoning"]["summary"]) == (MODEL, False, "auto")
    assert final["tools"] == body["tools"]  # echoed as sent, hosted tools and namespaces included
    if body["input"][-1].get("type") == "compaction_trigger":
        assert kinds[2:4] == ["response.output_item.added", "response.compaction.compacting"]
        if final["status"] == "failed":  # a random model's greedy summary loops: nothing is replaced
            assert final["error"]["code"] == "compaction_failed"
        else:
            assert [item["type"] for item in final["output"]] == ["compaction"]
        return
    assert final["status"] in ("completed", "incomplete")
    for item in final["output"]:
        assert item["type"] in ("message", "function_call", "custom_tool_call")
        if item["type"] == "function_call" and "." in item["name"]:
            pytest.fail(f"a namespaced call came back under the model's name: {item}")


def _codex(server: RunningServer, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    codex = agent_binary("codex", "@openai/codex")
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(provider_config(server.base_url))
    return subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", *extra, "Say hello in one word."],
        cwd=work,
        env=codex_environment(home),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def _completed(server: RunningServer) -> int:
    return int(httpx.get(f"{server.base_url}/health").json()["scheduler"]["completed"])


def test_codex_exec_runs_against_the_server(server: RunningServer, tmp_path: Path) -> None:
    before = _completed(server)
    run = _codex(server, tmp_path)
    assert run.returncode == 0, f"stdout: {run.stdout}\nstderr: {run.stderr}"
    assert _completed(server) > before  # it was answered here, not somewhere else


def test_codex_exec_runs_over_the_responses_websocket(server: RunningServer, tmp_path: Path) -> None:
    before = _completed(server)
    opened = _sockets_opened(server)
    run = _codex(server, tmp_path, "-c", f"model_providers.{PROVIDER}.supports_websockets=true")
    assert run.returncode == 0, f"stdout: {run.stdout}\nstderr: {run.stderr}"
    assert _completed(server) > before
    assert _sockets_opened(server) > opened  # over the socket, not the HTTP fallback


def _sockets_opened(server: RunningServer) -> int:
    return sum("responses websocket: a connection opened (codex" in line for line in server.lines)


def test_the_websocket_needs_the_api_key_as_http_does(server: RunningServer) -> None:
    url = server.base_url.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers={"Authorization": "Bearer wrong"})
    assert refused.value.response.status_code == 401
    with connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as socket:
        socket.send(orjson.dumps({"type": "response.create", "model": MODEL, "input": "hi", "max_output_tokens": 2}))
        kinds: list[str] = []
        while not kinds or kinds[-1] not in TERMINAL:
            kinds.append(orjson.loads(socket.recv())["type"])
        socket.send("not json")
        assert orjson.loads(socket.recv())["error"]["type"] == "invalid_request_error"
    assert kinds[0] == "response.created"
