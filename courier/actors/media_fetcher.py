"""MediaFetcherActor: reads a request's images (http(s), data:, file://) under the media policy.

Receives `FetchImages` only for requests the ingress has already admitted (the
model accepts images, the count is within `--max-images`), so a refused request
never reaches it. A request's distinct URLs are read side by side; each is read
once per `FetchMemo` and a failed one is not retried; the first failing part (in
request order) answers the whole request with a 400 naming it.
Requests are served concurrently (`runtime/concurrent_actor.py`): one slow host
holds up only its own request. Each read is a `media_fetcher.fetch` span.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio

from courier.media.address_policy import MediaRefused
from courier.media.fetcher import MediaFetcher
from courier.media.images import FetchedImage
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.media import FetchImages, FetchMemo, FetchReply, ImageRef, ImagesFetched, MediaFetcherMessage
from courier.runtime.concurrent_actor import ConcurrentActor
from courier.runtime.tracing import tracer

MAX_CONCURRENT_REQUESTS = 8


class MediaFetcherActor(ConcurrentActor[MediaFetcherMessage]):
    name = "media_fetcher"
    max_concurrent = MAX_CONCURRENT_REQUESTS

    def __init__(self, fetcher: MediaFetcher) -> None:
        super().__init__()
        self._fetcher = fetcher

    async def serve(self, message: FetchImages) -> FetchReply:
        memo = message.memo
        wanted = {ref.url: ref for ref in message.images if ref.url not in memo.results}
        async with anyio.create_task_group() as fetches:  # a request's URLs are read side by side
            for ref in wanted.values():
                fetches.start_soon(self._fetch_into, ref, memo)
        images: list[FetchedImage] = []
        for ref in message.images:
            result = memo.results[ref.url]
            if isinstance(result, RequestFailed):
                return RequestFailed(kind=result.kind, message=f"{ref.param}: {result.message}", param=ref.param)
            images.append(result)
        return ImagesFetched(images=tuple(images))

    async def _fetch_into(self, ref: ImageRef, memo: FetchMemo) -> None:
        memo.results[ref.url] = await self._fetch(ref)
        memo.fetches += 1

    async def _fetch(self, ref: ImageRef) -> FetchedImage | RequestFailed:
        scheme = urlsplit(ref.url).scheme.lower()
        with tracer().start_as_current_span("media_fetcher.fetch") as span:
            span.set_attribute("courier.media.scheme", scheme)
            if scheme in ("http", "https"):
                span.set_attribute("courier.media.host", urlsplit(ref.url).hostname or "")
            try:
                image = await self._fetcher.fetch(ref.url)
            except MediaRefused as refused:
                span.set_attribute("courier.media.refused", str(refused))
                return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=str(refused), param=ref.param)
            span.set_attributes({"courier.media.bytes": len(image.data), "courier.media.format": image.format})
            return image

    async def background(self) -> None:
        try:
            await super().background()
        finally:
            with anyio.CancelScope(shield=True):
                await self._fetcher.aclose()
