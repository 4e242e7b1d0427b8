"""A real HTTP server on an ephemeral port that counts the requests it gets, for media-fetch tests.

Routes: `/image.png` (a small PNG), `/held` (the same PNG, sent only once the test sets `release`; `held` is
set when it is asked for), `/redirect?to=URL` (302; quote the URL), `/stream?bytes=N` (N bytes of a PNG-looking
body sent in chunks, no Content-Length; counts what it managed to send), `/missing` (404). Each request's Host
header is kept in `hosts`. A test network backend (`RoutedBackend`) stands in for the internet: it connects a
public-looking address to this server, and records every address a fetcher asked to connect to.

Hostile images, generated: `png_header` (a valid PNG header claiming any size, and no pixels), `crafted_dds`
(Pillow raises NotImplementedError decoding it), `crafted_tiff` (TypeError).
"""

from __future__ import annotations

import io
import struct
import threading
import zlib
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


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` (8-bit RGBA) and whose image data is a few garbage bytes: tiny
    on the wire, huge if anything ever decoded it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def _saved(image_format: str) -> bytearray:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, format=image_format)
    return bytearray(buffer.getvalue())


def crafted_dds() -> bytes:
    """A DDS file whose pixel-format flags no decoder knows: Pillow raises NotImplementedError."""
    data = _saved("DDS")
    data[80:84] = struct.pack("<I", 0x91)
    return bytes(data)


def crafted_tiff() -> bytes:
    """A TIFF with one tag's type byte changed: Pillow raises TypeError reading it."""
    data = _saved("TIFF")
    data[72] = 2
    return bytes(data)


class MediaServer:
    def __init__(self, server: ThreadingHTTPServer) -> None:
        self._server = server
        self.requests: Counter[str] = Counter()
        self.hosts: list[str] = []
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
            served.hosts.append(self.headers.get("Host", ""))
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
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state["server"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class RoutedBackend(httpcore.AsyncNetworkBackend):
    """Connects each routed address (a public-looking stand-in for a host on the internet) to this machine's
    port for it; `connects` records every address asked for, routed or not."""

    def __init__(self, routes: dict[str, int]) -> None:
        self._routes = routes
        self.connects: list[str] = []
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        self.connects.append(host)
        if host not in self._routes:
            raise httpcore.ConnectError(f"{host} is not routed in this test")
        return await self._inner.connect_tcp("127.0.0.1", self._routes[host], timeout, local_address, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def routed_transport(backend: RoutedBackend) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(network_backend=backend)
    return transport
