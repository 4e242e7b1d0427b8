"""Record what Codex sends in the Responses dialect: real `codex exec` runs through a logging proxy in front of Courier.

    python -m tests.support.codex_recorder OUT_DIR COURIER_URL [path/to/codex]

COURIER_URL is a running Courier serving the 64K-window model of tests/support/agent_model.py as MODEL (Codex's
first prompt is ~9K tokens). Each run gets a fresh HOME and working directory and a `config.toml` naming Courier as
a `wire_api = "responses"` provider (`provider_config`); every request is written, exactly as Codex sent it, to
`OUT_DIR/dialect-<run>-NN.json` as `{method, path, headers, body}`, then forwarded to Courier, whose answer streams
back as it comes. The runs:

- `turn`: `codex exec "Say hello"`: one turn (function tools, a `namespace` group, `web_search`, `reasoning.summary`,
  `include: ["reasoning.encrypted_content"]`, `store: false`, a ~17,000-character developer message).
- `tool-loop`: the proxy forces the first turn's reply to be a call of `get_goal` (its forwarded copy gets that
  `tool_choice`; a random model would rarely call on its own), so Codex runs it and sends the call and its output
  back: the second request.
- `namespace`: the same, the forced call being `close_agent` of the `multi_agent_v1` namespace: it comes back as a
  `function_call` naming its `namespace`, which Codex runs (an unknown agent: an error as its output) and sends back.
- `compaction`: remote compaction v2 (`capabilities.remote_compaction = "v2"`) with a 2,000-token auto-compact limit
  and the same forced call: Codex compacts mid-turn with a request whose input ends with `{"type":
  "compaction_trigger"}`, and expects exactly one `compaction` item back. The random model's greedy summary is
  empty, so the run fails there; its requests are what it is for.

Nothing secret is sent (the key is a fixed test key) and nothing leaves the machine.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

API_KEY = "sk-test-codex"  # what the runs send as Authorization: Bearer
MODEL = "courier-model"
PROVIDER = "courier"
KEY_VARIABLE = "COURIER_API_KEY"
# Headers that describe the connection to the proxy, not the request.
HOP_HEADERS = frozenset({"host", "connection", "accept-encoding", "content-length", "transfer-encoding"})
RUN_TIMEOUT_S = 120
GET_GOAL = {"type": "function", "name": "get_goal"}
CLOSE_AGENT = {"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"}
COMPACTION_SETTINGS = (
    "-c",
    "model_auto_compact_token_limit=2000",
    "-c",
    "model_context_window=65536",
    "-c",
    f'model_providers.{PROVIDER}.capabilities={{remote_compaction="v2"}}',
)


def provider_config(base_url: str) -> str:
    """`~/.codex/config.toml` for Courier at `base_url` (its `/v1`), the key in $COURIER_API_KEY."""
    return (
        f'model = "{MODEL}"\nmodel_provider = "{PROVIDER}"\n\n[model_providers.{PROVIDER}]\nname = "Courier"\n'
        f'base_url = "{base_url}/v1"\nenv_key = "{KEY_VARIABLE}"\nwire_api = "responses"\n'
    )


def codex_environment(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "HOME": str(home), KEY_VARIABLE: API_KEY}


class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # answers end when the connection closes: a stream passes through as it comes
    out: Path
    run: str
    upstream: tuple[str, int]
    numbers: itertools.count[int]
    forced: dict[str, str] | None  # the tool_choice the first request is forwarded with

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.loads(raw) if raw else None
        record = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
        path = self.out / f"dialect-{self.run}-{next(self.numbers):02d}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        forwarded = body
        forced = type(self).forced
        if forced is not None and isinstance(body, dict) and body.get("tools"):
            type(self).forced = None
            forwarded = {**body, "tool_choice": forced}
        headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_HEADERS}
        connection = http.client.HTTPConnection(*self.upstream, timeout=RUN_TIMEOUT_S)
        connection.request(self.command, self.path, body=json.dumps(forwarded).encode(), headers=headers)
        answer = connection.getresponse()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in HOP_HEADERS:
                self.send_header(name, value)
        self.end_headers()
        while chunk := answer.read1(65536):
            self.wfile.write(chunk)
            self.wfile.flush()


def record(
    out: Path, courier: str, codex: str, run: str, extra: tuple[str, ...] = (), forced: dict[str, str] | None = None
) -> int:
    """One `codex exec` run through the proxy; its exit code."""
    address = urlsplit(courier)
    handler = type(
        "Proxy",
        (_Proxy,),
        {
            "out": out,
            "run": run,
            "upstream": (address.hostname or "127.0.0.1", address.port or 80),
            "numbers": itertools.count(1),
            "forced": forced,
        },
    )
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as proxy, tempfile.TemporaryDirectory() as scratch:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        home, work = Path(scratch, "home"), Path(scratch, "work")
        (home / ".codex").mkdir(parents=True)
        work.mkdir()
        (home / ".codex" / "config.toml").write_text(provider_config(f"http://127.0.0.1:{proxy.server_address[1]}"))
        command = [codex, "exec", "--skip-git-repo-check", *extra, "Say hello"]
        done = subprocess.run(
            command,
            check=False,
            cwd=work,
            env=codex_environment(home),
            stdin=subprocess.DEVNULL,
            timeout=RUN_TIMEOUT_S,
        )
        proxy.shutdown()
        return done.returncode


def main(out: Path, courier: str, codex: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    assert record(out, courier, codex, "turn") == 0
    assert record(out, courier, codex, "tool-loop", forced=GET_GOAL) == 0
    assert record(out, courier, codex, "namespace", forced=CLOSE_AGENT) == 0
    record(out, courier, codex, "compaction", COMPACTION_SETTINGS, forced=GET_GOAL)


if __name__ == "__main__":
    default = Path(".npm-agents/node_modules/.bin/codex")
    codex = Path(sys.argv[3]) if len(sys.argv) > 3 else default
    main(Path(sys.argv[1]), sys.argv[2].rstrip("/"), str(codex.resolve()))
