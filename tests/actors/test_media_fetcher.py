"""MediaFetcherActor over real streams against a real counting HTTP server: each URL once per memo, every hostile
input a 400 naming its part (and the next request still served), and the image memory budget."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from PIL import ImageFile

from courier.actors.media_fetcher import MediaFetcherActor
from courier.media.fetcher import FetchLimits, MediaFetcher
from courier.media.images import combined_digest
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.media import FetchImages, FetchMemo, FetchReply, ImageRef, ImagesFetched, MediaFetcherMessage
from courier.runtime.actor import ask
from tests.support.media_server import MediaServer, crafted_dds, crafted_tiff, media_server, png_bytes, png_header

Outbox = MemoryObjectSendStream[MediaFetcherMessage]
MEMORY = 8 << 20  # the image memory budget in these tests: 8 MiB, about two 1000x1000 images


@dataclass
class Running:
    outbox: Outbox
    fetcher: MediaFetcher


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


@pytest.fixture
async def actor(tmp_path: Path) -> AsyncIterator[Running]:
    (tmp_path / "blue.png").write_bytes(png_bytes(4, 4))
    limits = FetchLimits(
        max_bytes=1 << 20,
        max_pixels=50_000_000,
        media_root=tmp_path,
        allow_private=True,
        max_image_memory_bytes=MEMORY,
        memory_wait_s=5,
    )
    fetcher = MediaFetcher(limits)
    send, receive = anyio.create_memory_object_stream[MediaFetcherMessage](8)
    async with anyio.create_task_group() as tasks:
        await tasks.start(MediaFetcherActor(fetcher).run, receive)
        with send:
            yield Running(outbox=send, fetcher=fetcher)


async def fetch(outbox: Outbox, memo: FetchMemo, *refs: ImageRef) -> FetchReply:
    return await ask(outbox, lambda reply: FetchImages(images=refs, memo=memo, reply=reply))


def data_ref(data: bytes, param: str = "messages[0].content[1]") -> ImageRef:
    return ImageRef(url="data:image/png;base64," + base64.b64encode(data).decode(), param=param)


async def assert_still_serving(outbox: Outbox) -> None:
    served = await fetch(outbox, FetchMemo(), data_ref(png_bytes(4, 4)), ImageRef(url="file:///blue.png", param="b"))
    assert isinstance(served, ImagesFetched)
    assert [image.width for image in served.images] == [4, 4]


@pytest.mark.anyio
async def test_each_url_is_read_once_per_memo(actor: Running, server: MediaServer) -> None:
    image = ImageRef(url=server.url("/image.png"), param="messages[0].content[1]")
    again = ImageRef(url=server.url("/image.png"), param="messages[2].content[0]")
    inline = data_ref(png_bytes(4, 4), param="x")
    memo = FetchMemo()
    first = await fetch(actor.outbox, memo, image, again, inline)
    assert isinstance(first, ImagesFetched)
    assert [fetched.width for fetched in first.images] == [8, 8, 4]
    assert first.images[0].digest == first.images[1].digest != first.images[2].digest
    for _ in range(3):  # a compaction's counts render the same history again and again
        assert isinstance(await fetch(actor.outbox, memo, image, again), ImagesFetched)
    assert server.requests["/image.png"] == 1
    assert memo.fetches == 2
    other_request = await fetch(actor.outbox, FetchMemo(), image)
    assert isinstance(other_request, ImagesFetched)
    assert server.requests["/image.png"] == 2  # a new request reads it again
    assert first.images[0].budget is actor.fetcher.memory  # the render decodes them under the same budget
    assert actor.fetcher.memory.held == 0


@pytest.mark.anyio
async def test_a_failed_url_is_not_retried_and_names_its_part(actor: Running, server: MediaServer) -> None:
    missing = ImageRef(url=server.url("/missing"), param="input[1].content[0]")
    memo = FetchMemo()
    for _ in range(3):
        failed = await fetch(actor.outbox, memo, missing)
        assert isinstance(failed, RequestFailed)
        assert failed.param == "input[1].content[0]"
        assert "HTTP 404" in failed.message
    assert server.requests["/missing"] == 1


@pytest.mark.anyio
async def test_digests_differ_by_image(actor: Running) -> None:
    one = await fetch(actor.outbox, FetchMemo(), data_ref(png_bytes(8, 8)))
    two = await fetch(actor.outbox, FetchMemo(), data_ref(png_bytes(9, 8)))
    assert isinstance(one, ImagesFetched) and isinstance(two, ImagesFetched)
    assert combined_digest(one.images) != combined_digest(two.images)


# URLs that never passed the request validators (a stored item, another caller): the fetcher refuses them itself.
HOSTILE_URLS = [
    ("http://[::1/x.png", "not a valid URL"),
    ("http://a..b/x.png", "not a valid name"),
    (f"http://{'a' * 64}.example/x.png", "not a valid name"),
    ("file:///blue\x00.png", "NUL"),
    ("file:///blue%00.png", "NUL"),
    ("data:text/html;base64,PHNjcmlwdD4=", "data:image/<type>;base64"),
    ("ftp://example.com/x.png", "not ftp"),
]
HOSTILE_IMAGES = [
    (png_header(7000, 7000), "over --max-image-memory-bytes"),  # 69 bytes claiming 196 MB of pixels
    (png_header(1000, 1000), "not a decodable image"),  # within the budget, and no pixels to decode
    (crafted_dds(), "not a decodable image"),
    (crafted_tiff(), "not a decodable image"),
    (b"\x89PNG\r\n\x1a\n" + b"\xff" * 100, "not a decodable image"),
]


@pytest.mark.parametrize(("url", "reason"), HOSTILE_URLS)
@pytest.mark.anyio
async def test_a_hostile_url_is_a_400_and_the_next_request_is_served(actor: Running, url: str, reason: str) -> None:
    failed = await fetch(
        actor.outbox, FetchMemo(), ImageRef(url="file:///blue.png", param="a"), ImageRef(url=url, param="b")
    )
    assert isinstance(failed, RequestFailed)
    assert (failed.kind, failed.param) == (FailureKind.INVALID_REQUEST, "b")
    assert failed.message.startswith("b: ") and reason in failed.message
    await assert_still_serving(actor.outbox)


@pytest.mark.parametrize(("data", "reason"), HOSTILE_IMAGES)
@pytest.mark.anyio
async def test_a_hostile_image_is_a_400_and_the_next_request_is_served(
    actor: Running, data: bytes, reason: str
) -> None:
    failed = await fetch(actor.outbox, FetchMemo(), data_ref(data, param="input[2].content[0]"))
    assert isinstance(failed, RequestFailed)
    assert (failed.kind, failed.param) == (FailureKind.INVALID_REQUEST, "input[2].content[0]")
    assert reason in failed.message
    assert actor.fetcher.memory.held == 0
    await assert_still_serving(actor.outbox)


@pytest.mark.anyio
async def test_a_redirect_to_a_data_or_file_url_is_a_400(actor: Running, server: MediaServer) -> None:
    for location in ("data:image/png;base64," + base64.b64encode(png_bytes()).decode(), "file:///blue.png"):
        ref = ImageRef(url=server.url(f"/redirect?to={quote(location, safe='')}"), param="messages[0].content[0]")
        failed = await fetch(actor.outbox, FetchMemo(), ref)
        assert isinstance(failed, RequestFailed)
        assert failed.kind is FailureKind.INVALID_REQUEST
        assert "only http(s) redirects are followed" in failed.message
    await assert_still_serving(actor.outbox)


@pytest.mark.anyio
async def test_an_image_whose_decoding_raises_anything_is_a_400(
    actor: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load(self: ImageFile.ImageFile) -> None:
        raise KeyError("a decoder bug reached by crafted bytes")

    with monkeypatch.context() as patched:
        patched.setattr(ImageFile.ImageFile, "load", load)
        failed = await fetch(actor.outbox, FetchMemo(), data_ref(png_bytes(1, 1)))
    assert isinstance(failed, RequestFailed)
    assert failed.kind is FailureKind.INVALID_REQUEST
    assert "not a decodable image: KeyError" in failed.message
    await assert_still_serving(actor.outbox)


@pytest.mark.anyio
async def test_a_fault_of_ours_is_a_500_and_the_next_request_is_served(
    actor: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(url: str) -> None:
        raise RuntimeError("a bug in the fetcher")

    with monkeypatch.context() as patched:
        patched.setattr(actor.fetcher, "download", broken)
        failed = await fetch(actor.outbox, FetchMemo(), data_ref(png_bytes(1, 1), param="messages[1].content[0]"))
    assert isinstance(failed, RequestFailed)
    assert (failed.kind, failed.param) == (FailureKind.INTERNAL, "messages[1].content[0]")
    assert "bug" not in failed.message  # the client is not told our internals
    await assert_still_serving(actor.outbox)


@pytest.mark.anyio
async def test_a_request_whose_images_need_more_than_the_budget_names_the_one_that_crosses(actor: Running) -> None:
    fits = data_ref(png_header(1000, 1000), param="messages[0].content[0]")  # 4 MB each
    crosses = data_ref(png_header(1001, 1000), param="messages[0].content[2]")
    failed = await fetch(actor.outbox, FetchMemo(), fits, fits, crosses)  # each part is decoded for the render
    assert isinstance(failed, RequestFailed)
    assert failed.param == "messages[0].content[2]"
    assert f"over --max-image-memory-bytes ({MEMORY})" in failed.message
    assert actor.fetcher.memory.held == 0


@pytest.mark.anyio
async def test_a_request_that_would_overrun_what_others_hold_waits_its_turn(actor: Running) -> None:
    memory = actor.fetcher.memory
    await memory.acquire(MEMORY - 100)  # another request holds nearly all of it
    replies: list[FetchReply] = []

    async def request() -> None:
        replies.append(await fetch(actor.outbox, FetchMemo(), data_ref(png_bytes(40, 30))))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(request)
        while memory.waiting == 0:
            await anyio.sleep(0.001)
        assert replies == []
        memory.release(MEMORY - 100)
    assert isinstance(replies[0], ImagesFetched)
    assert memory.held == 0


@pytest.mark.anyio
async def test_the_wait_for_memory_ends_at_the_deadline(tmp_path: Path) -> None:
    limits = FetchLimits(max_bytes=1 << 20, max_pixels=1 << 20, media_root=None, allow_private=True, memory_wait_s=0.05)
    fetcher = MediaFetcher(limits)
    send, receive = anyio.create_memory_object_stream[MediaFetcherMessage](8)
    async with anyio.create_task_group() as tasks:
        await tasks.start(MediaFetcherActor(fetcher).run, receive)
        with send:
            await fetcher.memory.acquire(fetcher.memory.capacity)
            failed = await fetch(send, FetchMemo(), data_ref(png_bytes(4, 4), param="input[0].content[3]"))
            assert isinstance(failed, RequestFailed)
            assert (failed.kind, failed.param) == (FailureKind.TIMEOUT, "input[0].content[3]")
            assert "waited 0.05 s for image memory" in failed.message
            fetcher.memory.release(fetcher.memory.capacity)
            assert isinstance(await fetch(send, FetchMemo(), data_ref(png_bytes(4, 4))), ImagesFetched)
