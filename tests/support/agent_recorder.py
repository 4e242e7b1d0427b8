"""Record what Claude Code sends: the requests of a real `claude` run against a server that only records and replies.

    python -m tests.support.agent_recorder tests/data/agents/claude-code-VERSION [path/to/claude]

Two runs, each in a fresh HOME and working directory: `tool-loop` (`claude -p "Run echo hi" --max-turns 2
--allowedTools Bash`: the recorder's first reply thinks and calls Bash, so the second request sends back the
thinking block, the tool_use and its tool_result) and `bearer` (`ANTHROPIC_AUTH_TOKEN` and `ANTHROPIC_MODEL` set,
as a gateway set-up has them). Each request is written as `{method, path, headers, body}` to
`<run>-<n>.json`. Nothing secret is sent: the keys are the fixed test keys below, and nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

API_KEY = "sk-test-local"  # what the runs send as x-api-key
BEARER_KEY = "sk-test-bearer"  # as Authorization: Bearer, with ANTHROPIC_AUTH_TOKEN
NAMED_MODEL = "courier-model"  # ANTHROPIC_MODEL in the bearer run
QUIET = {"DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
RUN_TIMEOUT_S = 120


def _events(calls_tool: bool, model: str) -> list[tuple[str, dict[str, Any]]]:
    """A canned stream: thinking and a Bash call, or a short text."""
    message = {"id": "msg_rec", "type": "message", "role": "assistant", "model": model, "content": []}
    start = (
        "message_start",
        {"message": {**message, "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}},
    )
    if calls_tool:
        blocks: list[tuple[str, dict[str, Any]]] = [
            (
                "content_block_start",
                {"index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
            ),
            (
                "content_block_delta",
                {"index": 0, "delta": {"type": "thinking_delta", "thinking": "I should run echo."}},
            ),
            ("content_block_delta", {"index": 0, "delta": {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}}),
            ("content_block_stop", {"index": 0}),
            (
                "content_block_start",
                {"index": 1, "content_block": {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {}}},
            ),
            (
                "content_block_delta",
                {
                    "index": 1,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": '{"command": "echo hi", "description": "Say hi"}',
                    },
                },
            ),
            ("content_block_stop", {"index": 1}),
        ]
        reason = "tool_use"
    else:
        blocks = [
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hello."}}),
            ("content_block_stop", {"index": 0}),
        ]
        reason = "end_turn"
    end = [
        ("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": None}, "usage": {"output_tokens": 5}}),
        ("message_stop", {}),
    ]
    return [start, *blocks, *end]


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    out: Path
    run: str
    tool_loop: bool
    count = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self, body: Any) -> None:
        type(self).count += 1
        record = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()), "body": body}
        path = self.out / f"{self.run}-{type(self).count:02d}.json"
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

    def do_HEAD(self) -> None:
        self._record(None)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self._record(body)
        sent_back = any(
            isinstance(message.get("content"), list)
            and any(block.get("type") == "tool_result" for block in message["content"])
            for message in body.get("messages", [])
        )
        calls_tool = self.tool_loop and bool(body.get("tools")) and not sent_back
        data = b"".join(
            f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n".encode()
            for name, payload in _events(calls_tool, body.get("model", ""))
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def record(out: Path, claude: str, run: str, prompt: list[str], env: dict[str, str], tool_loop: bool) -> None:
    handler = type("Recorder", (_Recorder,), {"out": out, "run": run, "tool_loop": tool_loop, "count": 0})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server, tempfile.TemporaryDirectory() as scratch:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        home, work = Path(scratch, "home"), Path(scratch, "work")
        home.mkdir()
        work.mkdir()
        environment = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}",
            **QUIET,
            **env,
        }
        subprocess.run([claude, *prompt], cwd=work, env=environment, check=True, timeout=RUN_TIMEOUT_S)
        server.shutdown()


def main(out: Path, claude: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tool_prompt = ["-p", "Run echo hi", "--max-turns", "2", "--allowedTools", "Bash"]
    record(out, claude, "tool-loop", tool_prompt, {"ANTHROPIC_API_KEY": API_KEY}, tool_loop=True)
    named = {"ANTHROPIC_AUTH_TOKEN": BEARER_KEY, "ANTHROPIC_MODEL": NAMED_MODEL}
    record(out, claude, "bearer", ["-p", "Say hello", "--max-turns", "1"], named, tool_loop=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else str(Path(".npm-agents/node_modules/.bin/claude")))
