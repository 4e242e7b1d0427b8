"""The media fetcher's inbox: fetch a request's images, each URL at most once per `FetchMemo`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from courier.media.images import FetchedImage
from courier.messages.base import Request, RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageRef:
    """An image part of a request: its URL and where it sits in the body (for a 400 naming the part)."""

    url: str
    param: str


@dataclass(slots=True)
class FetchMemo:
    """One request's fetches (or one compaction's, whose counts render the history many times): each URL is read
    once, and a URL that failed is not tried again. Created by the request's owner, filled by the fetcher."""

    results: dict[str, FetchedImage | RequestFailed] = field(default_factory=dict)
    fetches: int = 0  # network/disk reads actually made


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagesFetched:
    images: tuple[FetchedImage, ...]


FetchReply: TypeAlias = ImagesFetched | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchImages(Request[ImagesFetched]):
    images: Sequence[ImageRef]
    memo: FetchMemo


MediaFetcherMessage: TypeAlias = FetchImages
