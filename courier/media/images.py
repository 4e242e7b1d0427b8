"""Checking fetched bytes are an image of bounded size, before anything decodes its pixels."""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from courier.media.address_policy import MediaRefused


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchedImage:
    data: bytes
    digest: str  # sha256 of the bytes: joins the prompt cache's bucket, so state is never shared across images
    format: str
    width: int
    height: int


def combined_digest(images: Sequence[FetchedImage]) -> str:
    """The multimodal digest of a prompt's images, in order: joins the prompt cache's bucket."""
    combined = hashlib.sha256()
    for image in images:
        combined.update(image.digest.encode())
    return combined.hexdigest()


def inspect_image(data: bytes, max_pixels: int) -> FetchedImage:
    """Read the header for the size (refusing over `max_pixels` before decoding), then verify and decode the data."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise MediaRefused(f"the image is {width}x{height}, over the limit of {max_pixels} pixels")
                image.verify()
                image_format = image.format or "unknown"
            with Image.open(io.BytesIO(data)) as image:
                image.load()  # every pixel decodes: a truncated file is refused here, not in the model's processor
    except MediaRefused:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning) as error:
        raise MediaRefused(f"not a decodable image: {type(error).__name__}") from None
    except Image.DecompressionBombError:
        raise MediaRefused(f"the image is over the limit of {max_pixels} pixels") from None
    return FetchedImage(
        data=data, digest=hashlib.sha256(data).hexdigest(), format=image_format, width=width, height=height
    )
