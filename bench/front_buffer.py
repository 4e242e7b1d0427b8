"""What the front's buffer costs each request: HAProxy started from `courier cluster haproxy-config`'s text for
several `--route-body-bytes`, in front of three small HTTP backends, each sent the same small keyed requests over
one kept-alive connection, in alternating rounds; beside them the same requests sent to a backend directly."""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.harness import cli
from bench.harness.report import progress, table, write_json
from bench.harness.servers import free_port
from bench.harness.stats import percentile
from courier.cluster.front_process import FrontProcess, unavailable_reason
from courier.cluster.haproxy_config import FrontOptions, haproxy_config
from courier.cluster.replicas import parse_replicas

MiB = 1024 * 1024
WINDOWS = {
    "16KiB": 16 * 1024,
    "1MiB": MiB,
    "2MiB (default)": 2 * MiB,
    "4MiB": 4 * MiB,
    "32MiB (the whole body)": 32 * MiB,
}
DIRECT = "direct to a backend (no front)"


class Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wbufsize = 65536  # an answer leaves in one write (no Nagle / delayed-ACK wait)

    def do_GET(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.do_GET()

    def log_message(self, *_: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # HAProxy closing a health check's connection as it stops


@dataclass(slots=True)
class Arm:
    name: str
    request_ms: list[float] = field(default_factory=list)
    front_cpu_ms: list[float] = field(default_factory=list)  # HAProxy's CPU per request, per round


@contextmanager
def backends(count: int) -> Iterator[list[int]]:
    servers = [QuietServer(("127.0.0.1", 0), Answer) for _ in range(count)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [server.server_address[1] for server in servers]
    finally:
        for server in servers:
            server.shutdown()


@contextmanager
def front(ports: list[int], route_body_bytes: int, directory: Path) -> Iterator[FrontProcess]:
    """HAProxy in front of `ports`, as `courier cluster up` runs it, reading `route_body_bytes` of each body."""
    replicas = parse_replicas([f"r{index}=127.0.0.1:{port}" for index, port in enumerate(ports, start=1)])
    port, socket_path = free_port(), directory / f"front-{route_body_bytes}.sock"
    options = FrontOptions(
        bind="127.0.0.1", port=port, route_body_bytes=route_body_bytes, check_interval_s=2, stats_socket=socket_path
    )
    process = FrontProcess(
        config_text=haproxy_config(replicas, options),
        port=port,
        directory=directory / f"front-{route_body_bytes}",
        stats_socket=socket_path,
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send(port: int, requests: int, arm: Arm) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for index in range(requests):
        # Bytes, so that the request line, headers and body leave in one write (no Nagle / delayed-ACK wait).
        body = json.dumps({"model": "m", "prompt_cache_key": f"conversation-{index % 16}", "input": "hi"}).encode()
        started = time.perf_counter()
        connection.request("POST", "/v1/responses", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        arm.request_ms.append((time.perf_counter() - started) * 1000)
        assert response.status == 200, response.status
    connection.close()


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--requests", type=cli.positive_int, default=200, help="per arm and round (default: 200)")
    parser.add_argument("--rounds", type=cli.positive_int, default=3, help="default: 3")
    parser.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = parser.parse_args()
    if reason := unavailable_reason():
        raise SystemExit(reason)
    arms = {name: Arm(name) for name in [DIRECT, *WINDOWS]}
    with tempfile.TemporaryDirectory() as directory, backends(3) as ports:
        for round_ in range(args.rounds):
            send(ports[0], args.requests, arms[DIRECT])
            for name, window in WINDOWS.items():
                progress(f"round {round_ + 1}: {name}")
                with front(ports, window, Path(directory)) as haproxy:
                    assert haproxy.pid is not None
                    send(haproxy.port, 10, Arm(name))  # warm: the first requests and checks allocate the pools
                    before = cpu_seconds(haproxy.pid)
                    send(haproxy.port, args.requests, arms[name])
                    arms[name].front_cpu_ms.append((cpu_seconds(haproxy.pid) - before) * 1000 / args.requests)
    table(
        "route body bytes | request ms p50 | p95 | HAProxy CPU ms per request (per round)",
        (
            f"{arm.name} | {percentile(arm.request_ms, 0.5):.2f} | {percentile(arm.request_ms, 0.95):.2f} | "
            + (", ".join(f"{cpu:.2f}" for cpu in arm.front_cpu_ms) or "-")
            for arm in arms.values()
        ),
    )
    write_json(list(arms.values()), args.json)


if __name__ == "__main__":
    main()
