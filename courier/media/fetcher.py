"""Fetching one media URL under the address policy, the redirect limit, the byte cap and the timeouts.

http(s): the host is resolved and every address checked before connecting; each
redirect (at most `max_redirects`) is checked the same way; and the address the
connection actually landed on is checked again before a byte of the body is
read, so a resolver answering public then private (DNS rebinding) gains nothing.
The body is streamed and cut at `max_bytes` (a declared Content-Length over it is
refused at once). `data:` and `file://` URLs are read locally (`local_sources`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import anyio
import httpx

from courier.media.address_policy import IPAddress, MediaRefused, check_addresses, parse_media_url, refusal_reason
from courier.media.images import FetchedImage, inspect_image
from courier.media.local_sources import confined_path, data_uri_bytes, read_confined

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchLimits:
    max_bytes: int
    max_pixels: int
    media_root: Path | None
    allow_private: bool
    connect_timeout_s: float = 5.0
    total_timeout_s: float = 10.0
    max_redirects: int = 5


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise MediaRefused(f"{host} does not resolve: {error}") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


class MediaFetcher:
    def __init__(
        self,
        limits: FetchLimits,
        resolver: Resolver = system_resolver,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._limits = limits
        self._resolver = resolver
        timeout = httpx.Timeout(limits.total_timeout_s, connect=limits.connect_timeout_s)
        self._client = httpx.AsyncClient(follow_redirects=False, timeout=timeout, transport=transport, trust_env=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str) -> FetchedImage:
        """The image at `url`, or `MediaRefused` saying why not."""
        limits = self._limits
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            data = data_uri_bytes(url, limits.max_bytes)
        elif scheme == "file":
            path = confined_path(limits.media_root, url)
            data = await anyio.to_thread.run_sync(read_confined, path, limits.max_bytes)
        else:
            try:
                with anyio.fail_after(limits.total_timeout_s):
                    data = await self._fetch_http(url)
            except TimeoutError:
                raise MediaRefused(f"the fetch took longer than {limits.total_timeout_s:g} s") from None
            except httpx.HTTPError as error:
                raise MediaRefused(f"the fetch failed: {type(error).__name__}: {error}") from None
        return await anyio.to_thread.run_sync(inspect_image, data, limits.max_pixels)

    async def _fetch_http(self, url: str) -> bytes:
        current = url
        for _ in range(self._limits.max_redirects + 1):
            target = parse_media_url(current)
            check_addresses(
                target.host, await self._resolver(target.host, target.port), allow_private=self._limits.allow_private
            )
            async with self._client.stream("GET", current) as response:
                self._check_peer(target.host, response)
                if response.status_code in REDIRECT_STATUSES:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaRefused(f"HTTP {response.status_code} without a Location")
                    current = urljoin(current, location)
                    continue
                if response.status_code != httpx.codes.OK:
                    raise MediaRefused(f"the server answered HTTP {response.status_code}")
                return await self._read_capped(response)
        raise MediaRefused(f"more than {self._limits.max_redirects} redirects")

    def _check_peer(self, host: str, response: httpx.Response) -> None:
        """The address the connection landed on, checked before any of the body is read."""
        if self._limits.allow_private:
            return
        stream: Any = response.extensions.get("network_stream")
        peer = stream.get_extra_info("server_addr") if stream is not None else None
        if not peer:
            raise MediaRefused(f"cannot tell which address {host} connected to")
        address = ipaddress.ip_address(str(peer[0]).split("%")[0])
        reason = refusal_reason(address)
        if reason is not None:
            raise MediaRefused(f"the connection to {host} landed on {address}, a {reason} address")

    async def _read_capped(self, response: httpx.Response) -> bytes:
        limit = self._limits.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise MediaRefused(f"the image is {declared} bytes, over --max-image-bytes ({limit})")
        received = bytearray()
        async for chunk in response.aiter_bytes():
            received += chunk
            if len(received) > limit:
                raise MediaRefused(f"the image is over --max-image-bytes ({limit} bytes); stopped reading")
        return bytes(received)
