"""The media fetcher against a real local HTTP server: resolve-check-pin, redirects, caps, decoding, the budget."""

from __future__ import annotations

import base64
import gzip
import ipaddress
from collections.abc import AsyncIterator, Iterator
from urllib.parse import quote

import anyio
import httpx
import pytest

from courier.media.address_policy import IPAddress, MediaRefused
from courier.media.fetcher import FetchLimits, MediaFetcher
from tests.support.media_server import MediaServer, RoutedBackend, media_server, png_bytes, png_header, routed_transport

PUBLIC = "93.184.216.34"
OTHER_PUBLIC = "93.184.216.35"


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


def limits(
    *, allow_private: bool, max_bytes: int = 1 << 20, max_pixels: int = 1 << 20, memory: int = 1 << 30
) -> FetchLimits:
    return FetchLimits(
        max_bytes=max_bytes,
        max_pixels=max_pixels,
        media_root=None,
        allow_private=allow_private,
        max_image_memory_bytes=memory,
        memory_wait_s=5,
    )


class Resolver:
    """A stand-in for DNS: each name answers from its list of answers in turn (the last one repeats); an address
    literal resolves to itself, as with a real resolver. Counts what it was asked."""

    def __init__(self, answers: dict[str, list[list[str]]]) -> None:
        self._answers = answers
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.asked.append(host)
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            answers = self._answers[host]
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            return [ipaddress.ip_address(address) for address in answer]


class Body(httpx.AsyncByteStream):
    """A response body as a real transport gives it: not read yet."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self._data


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.anyio
async def test_fetches_and_inspects_an_image(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=True))
    image = await fetcher.fetch(server.url("/image.png"))
    await fetcher.aclose()
    assert (image.format, image.width, image.height) == ("PNG", 8, 8)
    assert image.data == png_bytes()
    assert len(image.digest) == 64
    assert server.requests["/image.png"] == 1
    assert fetcher.memory.held == 0


@pytest.mark.anyio
async def test_the_connection_goes_to_the_checked_address_under_the_name(server: MediaServer) -> None:
    backend = RoutedBackend({PUBLIC: server.port})
    resolver = Resolver({"media.test": [[PUBLIC]]})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=resolver, transport=routed_transport(backend))
    image = await fetcher.fetch(f"http://media.test:{server.port}/image.png")
    await fetcher.aclose()
    assert image.width == 8
    assert backend.connects == [PUBLIC]
    assert server.hosts == [f"media.test:{server.port}"]  # the Host header stays the name


@pytest.mark.anyio
async def test_a_rebinding_host_never_receives_a_request_for_a_private_address(server: MediaServer) -> None:
    """DNS answers public, then loopback for ever after: the name is resolved once, and the connection goes to the
    public address checked; nothing asks the resolver again between the check and the connection."""
    backend = RoutedBackend({PUBLIC: server.port})
    resolver = Resolver({"rebind.test": [[PUBLIC], ["127.0.0.1"]]})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=resolver, transport=routed_transport(backend))
    await fetcher.fetch(f"http://rebind.test:{server.port}/image.png")
    with pytest.raises(MediaRefused, match=r"rebind\.test resolves to 127\.0\.0\.1, a loopback"):
        await fetcher.fetch(f"http://rebind.test:{server.port}/image.png")  # the next request resolves afresh
    await fetcher.aclose()
    assert resolver.asked == ["rebind.test", "rebind.test"]
    assert backend.connects == [PUBLIC]
    assert server.requests["/image.png"] == 1


@pytest.mark.parametrize(
    "answer",
    [["127.0.0.1"], [PUBLIC, "10.0.0.1"], ["169.254.169.254"], ["::ffff:127.0.0.1"], [PUBLIC, "fd00::1"]],
)
@pytest.mark.anyio
async def test_one_private_answer_refuses_before_any_connection(server: MediaServer, answer: list[str]) -> None:
    backend = RoutedBackend({PUBLIC: server.port})
    fetcher = MediaFetcher(
        limits(allow_private=False), resolver=Resolver({"mixed.test": [answer]}), transport=routed_transport(backend)
    )
    with pytest.raises(MediaRefused, match="resolves to"):
        await fetcher.fetch(f"http://mixed.test:{server.port}/image.png")
    await fetcher.aclose()
    assert backend.connects == []


@pytest.mark.anyio
async def test_an_address_that_cannot_be_connected_to_gives_way_to_the_next(server: MediaServer) -> None:
    backend = RoutedBackend({PUBLIC: server.port})  # OTHER_PUBLIC is not routed: its connection fails
    resolver = Resolver({"two.test": [[OTHER_PUBLIC, PUBLIC]]})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=resolver, transport=routed_transport(backend))
    assert (await fetcher.fetch(f"http://two.test:{server.port}/image.png")).width == 8
    await fetcher.aclose()
    assert backend.connects == [OTHER_PUBLIC, PUBLIC]


@pytest.mark.anyio
async def test_the_pinned_request_keeps_the_name_for_host_and_tls() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=Body(png_bytes()))

    resolver = Resolver({"xn--bcher-kva.example": [["2606:2800:220:1::1"]]})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=resolver, transport=httpx.MockTransport(answer))
    await fetcher.fetch("https://Bücher.example:8443/a.png?size=1#fragment")
    await fetcher.fetch(f"https://{PUBLIC}/b.png")
    await fetcher.aclose()
    named, literal = seen
    assert str(named.url) == "https://[2606:2800:220:1::1]:8443/a.png?size=1"
    assert named.headers["host"] == "xn--bcher-kva.example:8443"
    assert named.extensions["sni_hostname"] == "xn--bcher-kva.example"
    assert named.headers["accept-encoding"] == "identity"
    assert str(literal.url) == f"https://{PUBLIC}/b.png"
    assert "sni_hostname" not in literal.extensions


@pytest.mark.anyio
async def test_loopback_is_refused_before_connecting(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=False))
    with pytest.raises(MediaRefused, match="loopback"):
        await fetcher.fetch(server.url("/image.png"))
    await fetcher.aclose()
    assert server.requests["/image.png"] == 0


@pytest.mark.anyio
async def test_a_redirect_to_a_private_address_is_refused(server: MediaServer) -> None:
    # media.test is public; it redirects to the loopback address.
    backend = RoutedBackend({PUBLIC: server.port})
    resolver = Resolver({"media.test": [[PUBLIC]]})
    fetcher = MediaFetcher(limits(allow_private=False), resolver=resolver, transport=routed_transport(backend))
    target = quote(server.url("/image.png"), safe="")
    with pytest.raises(MediaRefused, match=r"resolves to 127\.0\.0\.1, a loopback"):
        await fetcher.fetch(f"http://media.test:{server.port}/redirect?to={target}")
    await fetcher.aclose()
    assert (server.requests["/redirect"], server.requests["/image.png"]) == (1, 0)
    assert backend.connects == [PUBLIC]


@pytest.mark.parametrize(
    ("location", "reason"),
    [
        (data_url(png_bytes()), "redirect to a data: URL is refused"),
        ("file:///etc/passwd", "redirect to a file: URL is refused"),
        ("ftp://example.com/a.png", "redirect to a ftp: URL is refused"),
        ("http://[::1/x.png", "not a valid URL"),
        ("http://a..b/x.png", "not a valid name"),
        ("http://user:pw@example.com/", "credentials"),
    ],
)
@pytest.mark.anyio
async def test_a_redirect_anywhere_but_http_is_refused(server: MediaServer, location: str, reason: str) -> None:
    fetcher = MediaFetcher(limits(allow_private=True))
    with pytest.raises(MediaRefused, match=reason):
        await fetcher.fetch(server.url(f"/redirect?to={quote(location, safe='')}"))
    await fetcher.aclose()


@pytest.mark.anyio
async def test_more_than_five_redirects_are_refused(server: MediaServer) -> None:
    url = server.url("/image.png")
    for _ in range(6):
        url = server.url(f"/redirect?to={quote(url, safe='')}")
    fetcher = MediaFetcher(limits(allow_private=True))
    with pytest.raises(MediaRefused, match="more than 5 redirects"):
        await fetcher.fetch(url)
    await fetcher.aclose()
    assert server.requests["/image.png"] == 0


@pytest.mark.anyio
async def test_the_byte_cap_stops_reading_mid_stream(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=True, max_bytes=256 * 1024))
    with pytest.raises(MediaRefused, match="stopped reading"):
        await fetcher.fetch(server.url("/stream?bytes=67108864"))
    await fetcher.aclose()
    assert server.streamed_bytes < 64 * 1024 * 1024  # the sender was cut off long before the end


@pytest.mark.anyio
async def test_a_compressed_body_is_never_inflated() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = gzip.compress(b"\0" * (4 << 20))  # 4 MiB of zeros in a few KiB
        return httpx.Response(200, stream=Body(body), headers={"Content-Encoding": "gzip"})

    fetcher = MediaFetcher(limits(allow_private=True, max_bytes=1 << 20), transport=httpx.MockTransport(answer))
    with pytest.raises(MediaRefused, match="not a decodable image"):  # the raw bytes: not an image
        await fetcher.fetch(f"http://{PUBLIC}/zeros.png")
    await fetcher.aclose()


@pytest.mark.anyio
async def test_http_errors_and_bad_images_are_refused(server: MediaServer) -> None:
    fetcher = MediaFetcher(limits(allow_private=True, max_pixels=1000))
    with pytest.raises(MediaRefused, match="HTTP 404"):
        await fetcher.fetch(server.url("/missing"))
    with pytest.raises(MediaRefused, match="not a decodable image"):
        await fetcher.fetch(data_url(b"not an image at all"))
    with pytest.raises(MediaRefused, match="100x100, over the limit of 1000 pixels"):
        await fetcher.fetch(data_url(png_bytes(100, 100)))
    assert (await fetcher.fetch(data_url(png_bytes(8, 8)))).width == 8
    await fetcher.aclose()


@pytest.mark.anyio
async def test_a_hostile_url_is_a_refusal_whatever_would_have_raised() -> None:
    fetcher = MediaFetcher(limits(allow_private=True))
    for url, reason in [
        ("http://[::1/x.png", "not a valid URL"),
        ("http://a..b/x.png", "not a valid name"),
        (f"http://{'a' * 64}.example/x.png", "not a valid name"),
        ("file:///x\x00.png", "NUL"),
        ("gopher://example.com/", "not gopher"),
    ]:
        with pytest.raises(MediaRefused, match=reason):
            await fetcher.fetch(url)
    await fetcher.aclose()


@pytest.mark.anyio
async def test_decoding_waits_for_its_share_of_the_memory_budget() -> None:
    fetcher = MediaFetcher(limits(allow_private=True, memory=40 * 30 * 4))
    download = await fetcher.download(data_url(png_bytes(40, 30)))
    assert fetcher.memory.held == 0  # reading the header costs nothing
    await fetcher.memory.acquire(1)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(fetcher.decode_all, [download])
        await anyio.wait_all_tasks_blocked()
        assert fetcher.memory.waiting == 1
        fetcher.memory.release(1)
    assert (fetcher.memory.held, fetcher.memory.waiting) == (0, 0)
    await fetcher.aclose()


@pytest.mark.anyio
async def test_a_huge_header_is_refused_by_the_budget_before_decoding() -> None:
    fetcher = MediaFetcher(limits(allow_private=True, max_pixels=50_000_000, memory=64 << 20))
    with pytest.raises(MediaRefused, match="over --max-image-memory-bytes"):
        await fetcher.fetch(data_url(png_header(7000, 7000)))
    assert fetcher.memory.held == 0
    await fetcher.aclose()
