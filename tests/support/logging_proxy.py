"""Record what an agent sends to Courier: a proxy that saves each request and forwards it, streams included.

    python -m tests.support.logging_proxy PORT COURIER_PORT OUT_DIR

Each request is written as `{method, path, headers, body}` to `OUT_DIR/NN.json`, exactly as the agent sent it, then
forwarded to the Courier on COURIER_PORT, whose answer streams back as it comes. What Courier does not serve yet is
left out of the forwarded copy only (`for_courier`), so the agent's session goes on and its next turn is recorded.
How tests/data/agents/codex/three-turns-*.json and another-session-01.json (Codex 0.171, `wire_api = "responses"`,
`codex exec` then `codex exec resume --last`) and tests/data/agents/claude-code/ (Claude Code 2.1.197, `claude -p`
then `--continue`) were recorded, against the 64K-window model of tests/support/agent_model.py. Nothing secret is
sent (the key is a fixed test key) and nothing leaves the machine.
"""

from __future__ import annotations

import http.client
import itertools
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# Headers that describe the connection to the proxy, not the request.
HOP_HEADERS = frozenset({"host", "connection", "accept-encoding", "content-length", "transfer-encoding"})
FORWARD_TIMEOUT_S = 600
# Tool types Courier's Responses API refuses today: Codex's `namespace` group of multi-agent tools, its web search.
UNSERVED_TOOLS = frozenset({"namespace", "web_search"})


def for_courier(body: Any) -> Any:
    """`body` as Courier serves it: Codex's tools of `UNSERVED_TOOLS` and its `reasoning.summary` left out, which
    Courier refuses (400) today. Anything else (Claude Code's requests whole) passes as it is."""
    if not isinstance(body, dict):
        return body
    adapted = dict(body)
    if isinstance(body.get("tools"), list):
        adapted["tools"] = [tool for tool in body["tools"] if tool.get("type") not in UNSERVED_TOOLS]
    if isinstance(body.get("reasoning"), dict):
        adapted["reasoning"] = {key: value for key, value in body["reasoning"].items() if key != "summary"}
    return adapted


def serve(port: int, upstream: int, out: Path) -> None:
    numbers = itertools.count(1)

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # answers end when the connection closes: a stream passes through as it comes

        def forward(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw) if raw else None
            record = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
            (out / f"{next(numbers):02d}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
            headers = {name: value for name, value in self.headers.items() if name.lower() not in HOP_HEADERS}
            connection = http.client.HTTPConnection("127.0.0.1", upstream, timeout=FORWARD_TIMEOUT_S)
            sent = json.dumps(for_courier(body)).encode() if raw else None
            connection.request(self.command, self.path, body=sent, headers=headers)
            answer = connection.getresponse()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in HOP_HEADERS:
                    self.send_header(name, value)
            self.end_headers()
            while chunk := answer.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()

        def do_GET(self) -> None:
            self.forward()

        def do_HEAD(self) -> None:
            self.forward()

        def do_POST(self) -> None:
            self.forward()

    ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
