"""The media fetcher against a real local HTTP server: caps, redirects, rebinding, decoding."""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest

from courier.media.address_policy import IPAddress, MediaRefused
from courier.media.fetcher import FetchLimits, MediaFetcher
from tests.support.media_server import MediaServer, RoutedBackend, media_server, png_bytes, routed_transport

PUBLIC = "93.184.216.34"


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


def limits(*, allow_private: bool, max_bytes: int = 1 << 20, max_pixels: int = 1 << 20) -> FetchLimits:
    return FetchLimits(max_bytes=max_bytes, max_pixels=max_pixels, media_root=None, allow_private=allow_private)


async def public_resolver(host: str, port: int) -> list[IPAddress]:
    """Every name resolves to a public address (the connection goes wherever the backend routes it); an address
    literal resolves to itself, as with a real resolver."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        return [ipaddress.ip_address(PUBLIC)]


@pytest.mark.anyio
async def test_fetches_and_inspects_an_image(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=True))
    image = await fetcher.fetch(server.url("/image.png"))
    await fetcher.aclose()
    assert (image.format, image.width, image.height) == ("PNG", 8, 8)
    assert image.data == png_bytes()
    assert len(image.digest) == 64
    assert server.requests["/image.png"] == 1


@pytest.mark.anyio
async def test_the_byte_cap_stops_reading_mid_stream(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=True, max_bytes=256 * 1024))
    with pytest.raises(MediaRefused, match="stopped reading"):
        await fetcher.fetch(server.url("/stream?bytes=67108864"))
    await fetcher.aclose()
    assert server.streamed_bytes < 64 * 1024 * 1024  # the sender was cut off long before the end


@pytest.mark.anyio
async def test_loopback_is_refused_before_connecting(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=False))
    with pytest.raises(MediaRefused, match="loopback"):
        await fetcher.fetch(server.url("/image.png"))
    await fetcher.aclose()
    assert server.requests["/image.png"] == 0


@pytest.mark.anyio
async def test_a_redirect_to_a_private_address_is_refused(server: MediaServer) -> None:
    # media.test is public (as resolved, and as connected); it redirects to the loopback address.
    backend = RoutedBackend({"media.test": server.port}, claim=PUBLIC)
    fetcher = MediaFetcher(limits(allow_private=False), resolver=public_resolver, transport=routed_transport(backend))
    target = server.url("/image.png")
    with pytest.raises(MediaRefused, match=r"resolves to 127\.0\.0\.1, a loopback"):
        await fetcher.fetch(f"http://media.test:{server.port}/redirect?to={target}")
    await fetcher.aclose()
    assert (server.requests["/redirect"], server.requests["/image.png"]) == (1, 0)


@pytest.mark.anyio
async def test_rebinding_is_caught_at_the_connected_address(server: MediaServer) -> None:
    # The resolver answers public, but the connection lands on 127.0.0.1.
    backend = RoutedBackend({"media.test": server.port})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=public_resolver, transport=routed_transport(backend))
    with pytest.raises(MediaRefused, match=r"landed on 127\.0\.0\.1"):
        await fetcher.fetch(f"http://media.test:{server.port}/image.png")
    await fetcher.aclose()


@pytest.mark.anyio
async def test_more_than_five_redirects_are_refused(server: MediaServer) -> None:
    url = server.url("/image.png")
    for _ in range(6):
        url = server.url(f"/redirect?to={url}")
    fetcher = MediaFetcher(limits(allow_private=True))
    with pytest.raises(MediaRefused, match="more than 5 redirects"):
        await fetcher.fetch(url)
    await fetcher.aclose()
    assert server.requests["/image.png"] == 0


@pytest.mark.anyio
async def test_http_errors_and_bad_images_are_refused(server: MediaServer, tmp_path: Path) -> None:
    fetcher = MediaFetcher(limits(allow_private=True, max_pixels=1000))
    with pytest.raises(MediaRefused, match="HTTP 404"):
        await fetcher.fetch(server.url("/missing"))
    junk = base64.b64encode(b"not an image at all").decode()
    with pytest.raises(MediaRefused, match="not a decodable image"):
        await fetcher.fetch(f"data:image/png;base64,{junk}")
    big = base64.b64encode(png_bytes(100, 100)).decode()
    with pytest.raises(MediaRefused, match="100x100, over the limit of 1000 pixels"):
        await fetcher.fetch(f"data:image/png;base64,{big}")
    small = base64.b64encode(png_bytes(8, 8)).decode()
    assert (await fetcher.fetch(f"data:image/png;base64,{small}")).width == 8
    await fetcher.aclose()
