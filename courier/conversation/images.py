"""The image rules, in one place: admitted before anything is read, then read once per memo.

Used by the ingress (a generation's images), the compactor (a history's counts) and
a Responses turn (its threshold count). Before any fetch message exists a request
is refused when it holds more than `--max-images` images, and, for a generation, when
the model accepts text only (400 `model_not_multimodal`, naming the first image
part). A text-only model's counts render image parts as text, so they read nothing
and refuse nothing. A vision model's images are read by the media fetcher, each URL
once per `FetchMemo` (a request's, or a compaction's across all its counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectSendStream

from courier.core.failure_codes import FailureCode
from courier.media.images import FetchedImage
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.media import FetchImages, FetchMemo, ImageRef, MediaFetcherMessage

IN_ONE_REQUEST = "in one request"
IN_THE_HISTORY = "in the history"


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageAdmission:
    max_images: int  # --max-images
    model_id: str
    fetcher: MemoryObjectSendStream[MediaFetcherMessage] | None  # None: the model accepts text only

    @property
    def accepts_images(self) -> bool:
        return self.fetcher is not None

    def refusal(
        self, images: Sequence[ImageRef], *, generating: bool, where: str = IN_ONE_REQUEST
    ) -> RequestFailed | None:
        """Why `images` may not be read, before anything is: over the cap, or a text-only model asked to generate
        from them. None: admitted."""
        if not images or (not generating and not self.accepts_images):
            return None
        if len(images) > self.max_images:
            message = f"{len(images)} images {where}; at most {self.max_images} are accepted (--max-images)"
            return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=message, param=images[self.max_images].param)
        if self.accepts_images:
            return None
        first = images[0].param
        message = (
            f"The model '{self.model_id}' accepts text only, and {first} is an image; send text, or serve a vision "
            "model"
        )
        return RequestFailed(
            kind=FailureKind.INVALID_REQUEST, message=message, param=first, code=FailureCode.MODEL_NOT_MULTIMODAL
        )

    async def read(self, images: Sequence[ImageRef], memo: FetchMemo) -> tuple[FetchedImage, ...]:
        """An admitted request's images, read through the media fetcher (none for a text-only model); a part that
        cannot be read is `Refused` naming it."""
        if not images or not self.accepts_images:
            return ()
        assert self.fetcher is not None
        refs = tuple(images)
        fetched = await call(self.fetcher, lambda reply: FetchImages(images=refs, memo=memo, reply=reply))
        return fetched.images

    async def admit_for_count(
        self, images: Sequence[ImageRef], memo: FetchMemo, *, where: str = IN_ONE_REQUEST
    ) -> tuple[FetchedImage, ...]:
        """The images a token count must see: checked against the cap, then read (none for a text-only model)."""
        refused = self.refusal(images, generating=False, where=where)
        if refused is not None:
            raise Refused(refused)
        return await self.read(images, memo)
