"""MediaFetcherActor over real streams against a real counting HTTP server: each URL once per memo."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator

import anyio
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.media_fetcher import MediaFetcherActor
from courier.media.fetcher import FetchLimits, MediaFetcher
from courier.media.images import combined_digest
from courier.messages.base import RequestFailed
from courier.messages.media import FetchImages, FetchMemo, FetchReply, ImageRef, ImagesFetched, MediaFetcherMessage
from courier.runtime.actor import ask
from tests.support.media_server import MediaServer, media_server, png_bytes

Outbox = MemoryObjectSendStream[MediaFetcherMessage]


@pytest.fixture
def server() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


@pytest.fixture
async def outbox() -> AsyncIterator[Outbox]:
    limits = FetchLimits(max_bytes=1 << 20, max_pixels=1 << 20, media_root=None, allow_private=True)
    send, receive = anyio.create_memory_object_stream[MediaFetcherMessage](8)
    async with anyio.create_task_group() as tasks:
        await tasks.start(MediaFetcherActor(MediaFetcher(limits)).run, receive)
        with send:
            yield send


async def fetch(outbox: Outbox, memo: FetchMemo, *refs: ImageRef) -> FetchReply:
    return await ask(outbox, lambda reply: FetchImages(images=refs, memo=memo, reply=reply))


@pytest.mark.anyio
async def test_each_url_is_read_once_per_memo(outbox: Outbox, server: MediaServer) -> None:
    image = ImageRef(url=server.url("/image.png"), param="messages[0].content[1]")
    again = ImageRef(url=server.url("/image.png"), param="messages[2].content[0]")
    inline = ImageRef(url="data:image/png;base64," + base64.b64encode(png_bytes(4, 4)).decode(), param="x")
    memo = FetchMemo()
    first = await fetch(outbox, memo, image, again, inline)
    assert isinstance(first, ImagesFetched)
    assert [fetched.width for fetched in first.images] == [8, 8, 4]
    assert first.images[0].digest == first.images[1].digest != first.images[2].digest
    for _ in range(3):  # a compaction's counts render the same history again and again
        assert isinstance(await fetch(outbox, memo, image, again), ImagesFetched)
    assert server.requests["/image.png"] == 1
    assert memo.fetches == 2
    other_request = await fetch(outbox, FetchMemo(), image)
    assert isinstance(other_request, ImagesFetched)
    assert server.requests["/image.png"] == 2  # a new request reads it again


@pytest.mark.anyio
async def test_a_failed_url_is_not_retried_and_names_its_part(outbox: Outbox, server: MediaServer) -> None:
    missing = ImageRef(url=server.url("/missing"), param="input[1].content[0]")
    memo = FetchMemo()
    for _ in range(3):
        failed = await fetch(outbox, memo, missing)
        assert isinstance(failed, RequestFailed)
        assert failed.param == "input[1].content[0]"
        assert "HTTP 404" in failed.message
    assert server.requests["/missing"] == 1


@pytest.mark.anyio
async def test_digests_differ_by_image(outbox: Outbox) -> None:
    red = ImageRef(url="data:image/png;base64," + base64.b64encode(png_bytes(8, 8)).decode(), param="a")
    wide = ImageRef(url="data:image/png;base64," + base64.b64encode(png_bytes(9, 8)).decode(), param="b")
    one = await fetch(outbox, FetchMemo(), red)
    two = await fetch(outbox, FetchMemo(), wide)
    assert isinstance(one, ImagesFetched) and isinstance(two, ImagesFetched)
    assert combined_digest(one.images) != combined_digest(two.images)
