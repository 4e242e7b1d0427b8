"""Checking fetched bytes are an image of bounded size, and decoding them, under the image memory budget.

Three steps, each on a worker thread (decoding is CPU work): `probe_image` reads
only the header (format and size, refused over `--max-image-pixels`), which is
what the memory budget is charged from; `decode_image` then decodes every pixel
once, so a truncated or crafted file is a 400 naming its part here rather than a
failure inside the model's processor, and drops the pixels; `decoded_pixels`
decodes them again for the render and holds them while the processor runs.

Pillow can raise almost anything on crafted bytes (NotImplementedError for an
unknown DDS pixel format, TypeError for a TIFF tag of the wrong type, MemoryError,
DecompressionBombError...): every exception while probing or decoding is the
image's fault, a `MediaRefused`. Only the common web formats are opened at all
(`IMAGE_FORMATS`), which keeps Pillow's rarer decoders (and EPS's Ghostscript)
away from client bytes.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from PIL import Image, UnidentifiedImageError

from courier.media.address_policy import MediaRefused
from courier.media.memory_budget import ImageMemoryBudget

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
BYTES_PER_PIXEL = 4  # what a decoded RGB(A) image takes in Pillow, and what the memory budget charges


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageHeader:
    """What an image's header claims, read before any pixel is decoded."""

    format: str
    width: int
    height: int

    @property
    def decoded_bytes(self) -> int:
        return self.width * self.height * BYTES_PER_PIXEL


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchedImage:
    data: bytes
    digest: str  # sha256 of the bytes: joins the prompt cache's bucket, so state is never shared across images
    format: str
    width: int
    height: int
    # The budget its pixels are decoded under again for the render (None: outside a server, nothing to share).
    budget: ImageMemoryBudget | None = field(default=None, compare=False, repr=False)

    @property
    def decoded_bytes(self) -> int:
        return self.width * self.height * BYTES_PER_PIXEL


def combined_digest(images: Sequence[FetchedImage]) -> str:
    """The multimodal digest of a prompt's images, in order: joins the prompt cache's bucket."""
    combined = hashlib.sha256()
    for image in images:
        combined.update(image.digest.encode())
    return combined.hexdigest()


def probe_image(data: bytes, max_pixels: int) -> ImageHeader:
    """The header's format and size, refusing an image over `max_pixels` before anything is decoded."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            header = ImageHeader(format=image.format or "unknown", width=image.size[0], height=image.size[1])
    except UnidentifiedImageError:
        raise MediaRefused(f"not a decodable image: not one of {', '.join(IMAGE_FORMATS)}") from None
    except Image.DecompressionBombError:
        raise MediaRefused(f"the image is over the limit of {max_pixels} pixels") from None
    except Exception as error:  # anything at all on crafted bytes: the image's fault
        raise MediaRefused(f"not a decodable image: {type(error).__name__}") from None
    if header.width <= 0 or header.height <= 0:
        raise MediaRefused(f"not a decodable image: its header says {header.width}x{header.height}")
    if header.width * header.height > max_pixels:
        raise MediaRefused(f"the image is {header.width}x{header.height}, over the limit of {max_pixels} pixels")
    return header


def decode_image(data: bytes, header: ImageHeader, budget: ImageMemoryBudget | None = None) -> FetchedImage:
    """Verify the file and decode every pixel (the caller holds `header.decoded_bytes` of the budget), then drop
    them: what comes back is the bytes, checked."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            image.verify()
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.size != (header.width, header.height):  # the same bytes, read twice: only a crafted file differs
                raise MediaRefused("not a decodable image: its header changed between two reads")
            image.load()  # every pixel decodes: a truncated file is refused here, not in the model's processor
    except MediaRefused:
        raise
    except MemoryError:
        raise MediaRefused("not a decodable image: decoding it ran out of memory") from None
    except Image.DecompressionBombError:
        raise MediaRefused("the image is over Pillow's decompression bomb limit") from None
    except Exception as error:  # Pillow on crafted bytes can raise anything: the image's fault, never the server's
        raise MediaRefused(f"not a decodable image: {type(error).__name__}") from None
    digest = hashlib.sha256(data).hexdigest()
    return FetchedImage(
        data=data, digest=digest, format=header.format, width=header.width, height=header.height, budget=budget
    )


@contextmanager
def decoded_pixels(images: Sequence[FetchedImage]) -> Iterator[list[Image.Image]]:
    """The images decoded to RGB, for the model's processor, on a worker thread: their decoded bytes are held from
    the images' budget (waiting for them) from before the first decode until the block ends."""
    budget = next((image.budget for image in images if image.budget is not None), None)
    need = sum(image.decoded_bytes for image in images)
    with budget.held_in_worker_thread(need) if budget is not None else nullcontext():
        pictures: list[Image.Image] = []
        try:
            for image in images:
                pictures.append(_rgb(image))
            yield pictures
        finally:
            for picture in pictures:
                picture.close()


def _rgb(image: FetchedImage) -> Image.Image:
    """One decoded copy: an RGB file is returned as loaded, anything else converted (the original then closed)."""
    opened = Image.open(io.BytesIO(image.data), formats=IMAGE_FORMATS)
    try:
        opened.load()
        converted = opened if opened.mode == "RGB" else opened.convert("RGB")
    except BaseException:
        opened.close()
        raise
    if converted is not opened:
        opened.close()
    return converted
