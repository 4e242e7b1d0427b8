"""The media fetcher's inbox: fetch a request's images, each URL at most once per request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from courier.media.images import FetchedImage
from courier.messages.base import FailureKind, Message, ReplyStream, RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageRef:
    """An image part of a request: its URL and where it sits in the body (for a 400 naming the part)."""

    url: str
    param: str


def over_image_cap(images: Sequence[ImageRef], cap: int, where: str = "in one request") -> RequestFailed | None:
    """The `--max-images` refusal (a 400 naming the first image over the cap), or None within it."""
    if len(images) <= cap:
        return None
    message = f"{len(images)} images {where}; at most {cap} are accepted (--max-images)"
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=images[cap].param)


@dataclass(slots=True)
class FetchMemo:
    """One request's fetches (or one compaction's, whose counts render the history many times): each URL is read
    once, and a URL that failed is not tried again. Created by the request's owner, filled by the fetcher."""

    results: dict[str, FetchedImage | RequestFailed] = field(default_factory=dict)
    fetches: int = 0  # network/disk reads actually made


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagesFetched:
    images: tuple[FetchedImage, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class VisionInputs:
    """A prompt's images as the model's processor prepared them, for the engine's prefill.

    `arrays` are the keyword arguments of the vision model's `get_input_embeddings` (pixel values, masks),
    as MLX arrays; `digest` joins the prompt cache's bucket, so state is never reused across images.
    """

    arrays: Mapping[str, Any]
    digest: str


FetchReply: TypeAlias = ImagesFetched | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchImages(Message):
    images: Sequence[ImageRef]
    memo: FetchMemo
    reply: ReplyStream[FetchReply]


MediaFetcherMessage: TypeAlias = FetchImages
