"""MediaFetcherActor: reads a request's images (http(s), data:, file://) under the media policy and memory budget.

Receives `FetchImages` only for requests the ingress has already admitted (the
model accepts images, the count is within `--max-images`), so a refused request
never reaches it. A request's distinct URLs are read side by side; each is read
once per `FetchMemo` and a failed one is not retried. Then the request's images
are charged to the image memory budget together, by the sizes their headers
claim: a request whose images need more than the whole budget is a 400 naming
the image that crosses it; one that would overrun what other requests hold waits
(at most `memory_wait_s`, the request deadline: then a 504). Only then is every
pixel decoded, on worker threads, and dropped. The first failing part (in
request order) answers the whole request with a 400 naming it.

Invariant: nothing a request holds escapes as an exception. Whatever a URL or an
image does is that part's `RequestFailed`; a fault of ours is logged with its
traceback and answered 500, and the actor keeps serving the next request.
Requests are served concurrently (`runtime/concurrent_actor.py`): one slow host
holds up only its own request. Each read is a `media_fetcher.fetch` span.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

import anyio

from courier.media.address_policy import MediaRefused
from courier.media.fetcher import Download, MediaFetcher
from courier.media.images import FetchedImage
from courier.media.memory_budget import first_over
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.media import FetchImages, FetchMemo, FetchReply, ImageRef, ImagesFetched, MediaFetcherMessage
from courier.runtime.concurrent_actor import ConcurrentActor
from courier.runtime.tracing import tracer

logger = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 8


class MediaFetcherActor(ConcurrentActor[MediaFetcherMessage]):
    name = "media_fetcher"
    max_concurrent = MAX_CONCURRENT_REQUESTS

    def __init__(self, fetcher: MediaFetcher) -> None:
        super().__init__()
        self._fetcher = fetcher

    async def serve(self, message: FetchImages) -> FetchReply:
        try:
            return await self._serve(message)
        except Exception:  # a fault of ours, not the request's: this request fails, the server does not
            logger.exception("reading a request's images failed unexpectedly")
            param = message.images[0].param if message.images else None
            return RequestFailed(kind=FailureKind.INTERNAL, message="the images could not be read", param=param)

    async def _serve(self, message: FetchImages) -> FetchReply:
        memo = message.memo
        wanted = {ref.url: ref for ref in message.images if ref.url not in memo.results}
        downloads: dict[str, Download] = {}
        async with anyio.create_task_group() as reads:  # a request's URLs are read side by side
            for ref in wanted.values():
                reads.start_soon(self._download_into, ref, memo, downloads)
        refused = _first_failure(message.images, memo)
        if refused is not None:
            return refused
        over_budget = self._over_budget(message.images, memo, downloads)
        if over_budget is not None:
            return over_budget
        if not downloads:
            return ImagesFetched(images=tuple(_image(memo, ref) for ref in message.images))
        pending = list(downloads.items())
        try:
            decoded = await self._fetcher.decode_all([download for _, download in pending])
        except TimeoutError:
            param = wanted[pending[0][0]].param
            waited = f"waited {self._fetcher.limits.memory_wait_s:g} s for image memory other requests hold"
            return RequestFailed(kind=FailureKind.TIMEOUT, message=f"{param}: {waited}", param=param)
        for (url, _), result in zip(pending, decoded, strict=True):
            memo.results[url] = _invalid(str(result), wanted[url].param) if isinstance(result, MediaRefused) else result
        return _first_failure(message.images, memo) or ImagesFetched(
            images=tuple(_image(memo, ref) for ref in message.images)
        )

    async def _download_into(self, ref: ImageRef, memo: FetchMemo, downloads: dict[str, Download]) -> None:
        memo.fetches += 1
        with tracer().start_as_current_span("media_fetcher.fetch") as span:
            scheme = ref.url.partition(":")[0].lower()[:16]
            span.set_attribute("courier.media.scheme", scheme)
            if scheme in ("http", "https"):
                span.set_attribute("courier.media.host", _host_of(ref.url))
            try:
                download = await self._fetcher.download(ref.url)
            except MediaRefused as refused:
                span.set_attribute("courier.media.refused", str(refused))
                memo.results[ref.url] = _invalid(str(refused), ref.param)
                return
            span.set_attribute("courier.media.bytes", len(download.data))
            span.set_attribute("courier.media.format", download.header.format)
            downloads[ref.url] = download

    def _over_budget(
        self, images: Sequence[ImageRef], memo: FetchMemo, downloads: dict[str, Download]
    ) -> RequestFailed | None:
        """The whole request's decoded bytes against the whole budget (each part counts: the render decodes each)."""
        needs = [
            downloads[ref.url].header.decoded_bytes if ref.url in downloads else _image(memo, ref).decoded_bytes
            for ref in images
        ]
        capacity = self._fetcher.memory.capacity
        crossing = first_over(needs, capacity)
        if crossing is None:
            return None
        total = sum(needs[: crossing + 1])
        text = (
            f"the request's images need {total} bytes decoded (width x height x 4 each) up to this one, over "
            f"--max-image-memory-bytes ({capacity})"
        )
        param = images[crossing].param
        return _invalid(f"{param}: {text}", param)

    async def background(self) -> None:
        try:
            await super().background()
        finally:
            with anyio.CancelScope(shield=True):
                await self._fetcher.aclose()


def _first_failure(images: Sequence[ImageRef], memo: FetchMemo) -> RequestFailed | None:
    for ref in images:
        result = memo.results.get(ref.url)
        if isinstance(result, RequestFailed):
            return RequestFailed(kind=result.kind, message=f"{ref.param}: {result.message}", param=ref.param)
    return None


def _host_of(url: str) -> str:
    try:
        return urlsplit(url).hostname or ""
    except ValueError:  # a malformed URL: the fetcher refuses it, the span just has no host
        return ""


def _image(memo: FetchMemo, ref: ImageRef) -> FetchedImage:
    result = memo.results[ref.url]
    assert isinstance(result, FetchedImage)
    return result


def _invalid(message: str, param: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=param)
