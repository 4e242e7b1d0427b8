"""A real HTTP server on an ephemeral port that counts the requests it gets, for media-fetch tests.

Routes: `/image.png` (a small PNG), `/held` (the same PNG, sent only once the test sets `release`; `held` is
set when it is asked for), `/redirect?to=URL` (302), `/stream?bytes=N` (N bytes of a PNG-looking
body sent in chunks, no Content-Length; counts what it managed to send), `/missing` (404). A test network
backend (`RoutedBackend`) lets a fetcher reach it under a public-looking host name and, when asked, claim
that the connection landed on a public address.
"""

from __future__ import annotations

import io
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpcore
import httpx
from PIL import Image


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class MediaServer:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self.requests: Counter[str] = Counter()
        self.streamed_bytes = 0
        self.held = threading.Event()  # `/held` was asked for
        self.release = threading.Event()  # `/held` answers once this is set

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def media_server() -> Iterator[MediaServer]:
    image = png_bytes()
    state: dict[str, MediaServer] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            served = state["server"]
            served.requests[parts.path] += 1
            query = parse_qs(parts.query)
            if parts.path == "/image.png":
                self._send(200, image, {"Content-Type": "image/png", "Content-Length": str(len(image))})
            elif parts.path == "/held":
                served.held.set()
                served.release.wait(timeout=60)
                self._send(200, image, {"Content-Type": "image/png", "Content-Length": str(len(image))})
            elif parts.path == "/redirect":
                self._send(302, b"", {"Location": query["to"][0], "Content-Length": "0"})
            elif parts.path == "/stream":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                total = int(query["bytes"][0])
                chunk = b"\x89PNG" + b"x" * 65532
                try:
                    while served.streamed_bytes < total:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        served.streamed_bytes += len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
            else:
                self._send(404, b"missing", {"Content-Length": "7"})

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state["server"] = MediaServer(server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["server"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class _ClaimedPeer(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, claimed: tuple[str, int]) -> None:
        self._inner = inner
        self._claimed = claimed

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._claimed if info == "server_addr" else self._inner.get_extra_info(info)


class RoutedBackend(httpcore.AsyncNetworkBackend):
    """Connects `host` to 127.0.0.1 (a stand-in for DNS); with `claim`, reports a public peer address."""

    def __init__(self, routes: dict[str, int], claim: str | None = None) -> None:
        self._routes = routes
        self._claim = claim
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        routed = host in self._routes
        stream = await self._inner.connect_tcp(
            "127.0.0.1" if routed else host, self._routes.get(host, port), timeout, local_address, socket_options
        )
        if routed and self._claim is not None:
            return _ClaimedPeer(stream, (self._claim, port))
        return stream

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def routed_transport(backend: RoutedBackend) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(network_backend=backend)
    return transport
