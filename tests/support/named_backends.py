"""Small real HTTP backends that stand in for replicas in front tests: each answers with its own name.

Every answer is JSON, `{"backend", "method", "path", "body_bytes"}`. `/health` answers 200 while
`ready` is set and 503 otherwise (a loading or draining replica); `stop()` closes the port (a replica
that is gone). `/stream` sends two server-sent events, the second ("second") only once the test sets
`release` ("never released" after a wait), so a test sees whether the front passes the first on
before the stream ends. HTTP/1.0, a connection per request, so a stopped backend cannot answer on a
connection it kept open.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RELEASE_TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    # Health checks every few tenths of a second and a test's requests must never find the accept queue full: a
    # dropped connection would fail a check and move keys the test is watching.
    request_queue_size = 128


class NamedBackend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = threading.Event()
        self.ready.set()
        self.release = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"backend-{name}", daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()


def _handler_for(backend: NamedBackend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200 if backend.ready.is_set() else 503)
            elif self.path == "/stream":
                self._stream()
            else:
                self._answer(200)

        def do_POST(self) -> None:
            self._answer(200)

        def do_DELETE(self) -> None:
            self._answer(200)

        def _answer(self, status: int) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            body = {"backend": backend.name, "method": self.command, "path": self.path, "body_bytes": length}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(f"data: {backend.name} first\n\n".encode())
            self.wfile.flush()
            released = backend.release.wait(RELEASE_TIMEOUT_S)
            self.wfile.write(b"data: second\n\n" if released else b"data: never released\n\n")

        def handle(self) -> None:
            with suppress(ConnectionError):  # a health check reads the status line and closes
                super().handle()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def named_backends(*names: str) -> Iterator[dict[str, NamedBackend]]:
    """Started backends by name, stopped when the block ends."""
    with ExitStack() as stack:
        backends = {name: NamedBackend(name) for name in names}
        for backend in backends.values():
            backend.start()
            stack.callback(backend.stop)
        yield backends
