"""Reading one media URL under the URL rules, the address policy, the redirect limit, the byte cap and the timeouts.

http(s) is resolve, check, pin: the host is resolved once, every address it
resolves to is checked against the policy, and the connection goes to one of
those very addresses (the request URL carries the address; the Host header and
the TLS server name stay the URL's host, so virtual hosts and certificates work
as usual). Nothing resolves the name a second time, so a resolver answering
public, then private (DNS rebinding) never gets a request to a private address.
Each redirect (at most `max_redirects`) is parsed, resolved, checked and pinned
the same way; one to a `data:`, `file:` or any other non-http(s) URL is refused.
No connection is kept alive, so none is ever reused under another name. The
body is read raw (`Accept-Encoding: identity`: a compressed body is not an
image, and nothing inflates) and cut at `max_bytes`. `data:` and `file://` URLs
are read locally (`local_sources`).

Reading (`download`) and decoding (`decode`) are separate, so that a request's
images can be charged to the memory budget, all together, between the two.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import anyio
import httpx

from courier.media.address_policy import IPAddress, MediaRefused, check_addresses
from courier.media.images import FetchedImage, ImageHeader, decode_image, probe_image
from courier.media.local_sources import confined_path, data_uri_bytes, read_confined
from courier.media.memory_budget import ImageMemoryBudget
from courier.media.urls import DataUri, FileUrl, HttpUrl, http_url, parse_image_url

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
USER_AGENT = "courier-media-fetcher"
# What a hostile server or URL can make httpx raise; none of it is a fault of ours.
_HTTPX_FAILURES = (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError)


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchLimits:
    max_bytes: int
    max_pixels: int
    media_root: Path | None
    allow_private: bool
    connect_timeout_s: float = 5.0
    total_timeout_s: float = 10.0
    max_redirects: int = 5
    max_image_memory_bytes: int = 1024**3  # --max-image-memory-bytes: decoded pixels held at once, all requests
    memory_wait_s: float = 600.0  # how long a request waits for its share of that (its deadline)


@dataclass(frozen=True, slots=True, kw_only=True)
class Download:
    """An image's bytes and what its header claims; not decoded yet."""

    data: bytes
    header: ImageHeader


async def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order, without repeats."""
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as error:  # idna's refusals are UnicodeErrors
        raise MediaRefused(f"{host} does not resolve: {error}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    return list(dict.fromkeys(addresses))


class MediaFetcher:
    def __init__(
        self,
        limits: FetchLimits,
        resolver: Resolver = system_resolver,
        transport: httpx.AsyncBaseTransport | None = None,
        memory: ImageMemoryBudget | None = None,
    ) -> None:
        self._limits = limits
        self._resolver = resolver
        self.memory = memory or ImageMemoryBudget(limits.max_image_memory_bytes)
        self._timeouts = httpx.Timeout(limits.total_timeout_s, connect=limits.connect_timeout_s).as_dict()
        # The transport, not a client: a client parses every Location itself (and raises on a data: one) even when
        # it follows no redirect. No connection is kept alive, so none is reused for another name.
        self._transport = transport or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_keepalive_connections=0), trust_env=False
        )

    @property
    def limits(self) -> FetchLimits:
        return self._limits

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def fetch(self, url: str) -> FetchedImage:
        """The image at `url`, read and decoded under the memory budget, or `MediaRefused` saying why not."""
        download = await self.download(url)
        need = download.header.decoded_bytes
        if need > self.memory.capacity:
            raise MediaRefused(f"the image needs {need} bytes decoded, over --max-image-memory-bytes")
        async with self.memory.reserved(need, wait_s=self._limits.memory_wait_s):
            return await self.decode(download)

    async def download(self, url: str) -> Download:
        """The bytes at `url` and their image header (nothing decoded), or `MediaRefused`."""
        limits = self._limits
        target = parse_image_url(url)
        if isinstance(target, DataUri):
            data = data_uri_bytes(target.url, limits.max_bytes)
        elif isinstance(target, FileUrl):
            path = confined_path(limits.media_root, url)
            data = await anyio.to_thread.run_sync(read_confined, path, limits.max_bytes)
        else:
            try:
                with anyio.fail_after(limits.total_timeout_s):
                    data = await self._fetch_http(target)
            except TimeoutError:
                raise MediaRefused(f"the fetch took longer than {limits.total_timeout_s:g} s") from None
            except _HTTPX_FAILURES as error:
                raise MediaRefused(f"the fetch failed: {type(error).__name__}: {error}") from None
        header = await anyio.to_thread.run_sync(probe_image, data, limits.max_pixels)
        return Download(data=data, header=header)

    async def decode(self, download: Download) -> FetchedImage:
        """Every pixel decoded once on a worker thread, then dropped; the caller holds the image's decoded bytes."""
        return await anyio.to_thread.run_sync(decode_image, download.data, download.header, self.memory)

    async def decode_all(self, downloads: Sequence[Download]) -> list[FetchedImage | MediaRefused]:
        """A request's images decoded side by side, under one reservation of their decoded bytes, taken (waiting
        for other requests to give theirs back, at most `memory_wait_s`: `TimeoutError`) before any is decoded."""
        results: list[FetchedImage | MediaRefused] = [MediaRefused("not decoded")] * len(downloads)

        async def decode_into(index: int, download: Download) -> None:
            try:
                results[index] = await self.decode(download)
            except MediaRefused as refused:
                results[index] = refused

        need = sum(download.header.decoded_bytes for download in downloads)
        async with (
            self.memory.reserved(need, wait_s=self._limits.memory_wait_s),
            anyio.create_task_group() as decodes,
        ):
            for index, download in enumerate(downloads):
                decodes.start_soon(decode_into, index, download)
        return results

    async def _fetch_http(self, url: HttpUrl) -> bytes:
        target = url
        for _ in range(self._limits.max_redirects + 1):
            response = await self._send_pinned(target)
            try:
                if response.status_code in REDIRECT_STATUSES:
                    target = _redirect_target(target, response)
                    continue
                if response.status_code != httpx.codes.OK:
                    raise MediaRefused(f"the server answered HTTP {response.status_code}")
                return await self._read_capped(response)
            finally:
                await response.aclose()
        raise MediaRefused(f"more than {self._limits.max_redirects} redirects")

    async def _send_pinned(self, target: HttpUrl) -> httpx.Response:
        """GET `target` over a connection to an address its host resolved to and the policy allowed; the next
        address is tried only when one cannot be connected to."""
        addresses = [target.address] if target.address is not None else await self._resolver(target.host, target.port)
        check_addresses(target.host, addresses, allow_private=self._limits.allow_private)
        extensions: dict[str, object] = {"timeout": self._timeouts}
        if target.address is None:
            # TLS sends, and checks the certificate against, the name (not the address it connects to).
            extensions["sni_hostname"] = target.host.rstrip(".")
        for index, address in enumerate(addresses):
            request = httpx.Request(
                "GET",
                httpx.URL(target.url).copy_with(host=str(address)),
                headers={"Host": target.host_header, "Accept-Encoding": "identity", "User-Agent": USER_AGENT},
                extensions=extensions,
            )
            try:
                response = await self._transport.handle_async_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if index == len(addresses) - 1:
                    raise
                continue
            response.request = request
            return response
        raise MediaRefused(f"{target.host} does not resolve")

    async def _read_capped(self, response: httpx.Response) -> bytes:
        limit = self._limits.max_bytes
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise MediaRefused(f"the image is {declared} bytes, over --max-image-bytes ({limit})")
        received = bytearray()
        async for chunk in response.aiter_raw():
            received += chunk
            if len(received) > limit:
                raise MediaRefused(f"the image is over --max-image-bytes ({limit} bytes); stopped reading")
        return bytes(received)


def _redirect_target(current: HttpUrl, response: httpx.Response) -> HttpUrl:
    """Where a redirect leads: an http(s) URL under the same rules, or `MediaRefused`."""
    location = response.headers.get("location")
    if not location:
        raise MediaRefused(f"HTTP {response.status_code} without a Location")
    try:
        joined = urljoin(current.url, location)
    except ValueError:
        raise MediaRefused("the redirect's Location is not a valid URL") from None
    scheme = joined.partition(":")[0].lower()
    if scheme not in ("http", "https"):
        shown = scheme if scheme.isalpha() and len(scheme) <= 16 else "non-http"
        raise MediaRefused(f"a redirect to a {shown}: URL is refused; only http(s) redirects are followed")
    return http_url(joined)
