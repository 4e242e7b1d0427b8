"""Probing and decoding client bytes: whatever Pillow raises is the image's fault, and pixels are charged for."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable

import anyio
import anyio.to_thread
import pytest
from PIL import Image, ImageFile

from courier.media import images
from courier.media.address_policy import MediaRefused
from courier.media.images import ImageHeader, decode_image, decoded_pixels, probe_image
from courier.media.memory_budget import ImageMemoryBudget
from tests.support.media_server import crafted_dds, crafted_tiff, png_bytes, png_header


def saved(image_format: str, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (8, 8)).save(buffer, format=image_format)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "not one of PNG"),
        (b"not an image at all", "not one of PNG"),
        (crafted_dds(), "not one of PNG"),  # DDS, TIFF, EPS...: their decoders never see client bytes
        (crafted_tiff(), "not one of PNG"),
        (saved("TIFF"), "not one of PNG"),
        (png_header(1001, 1000), "1001x1000, over the limit of 1000000 pixels"),
        (png_header(0, 10), "not a decodable image"),
        (png_header(2**31 - 1, 2**31 - 1), "over the limit"),
    ],
)
def test_a_header_that_is_refused_before_anything_is_decoded(data: bytes, reason: str) -> None:
    with pytest.raises(MediaRefused, match=reason):
        probe_image(data, 1_000_000)


def test_the_header_says_what_decoding_will_cost() -> None:
    header = probe_image(png_header(7000, 7000), 50_000_000)
    assert header == ImageHeader(format="PNG", width=7000, height=7000)
    assert header.decoded_bytes == 7000 * 7000 * 4  # 196 MB, from 69 bytes on the wire
    assert probe_image(saved("GIF", "P"), 100).format == "GIF"


@pytest.mark.parametrize(
    "data",
    [
        png_header(300, 200),  # a header and no pixels
        png_bytes(40, 30)[:-40],  # cut before its end
        png_bytes(40, 30)[:60] + b"\0" * 40 + png_bytes(40, 30)[100:],  # a damaged chunk
    ],
)
def test_bytes_that_do_not_decode_are_refused(data: bytes) -> None:
    header = probe_image(data, 1_000_000)
    with pytest.raises(MediaRefused, match="not a decodable image"):
        decode_image(data, header)


@pytest.mark.parametrize("data", [crafted_dds(), crafted_tiff()])
def test_even_the_rare_decoders_raise_nothing_but_refusals(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    """With every format let through, Pillow's NotImplementedError (DDS) and TypeError (TIFF) are refusals too."""
    monkeypatch.setattr(images, "IMAGE_FORMATS", None)
    with pytest.raises(MediaRefused, match=r"not a decodable image: (NotImplementedError|TypeError)"):
        decode_image(data, probe_image(data, 1_000_000))


def _raising(error: BaseException) -> Callable[..., object]:
    def load(self: ImageFile.ImageFile) -> object:
        raise error

    return load


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotImplementedError("unknown pixel format"), "NotImplementedError"),
        (TypeError("'str' object cannot be interpreted as an integer"), "TypeError"),
        (KeyError("tag"), "KeyError"),
        (IndexError("list index out of range"), "IndexError"),
        (ZeroDivisionError("division by zero"), "ZeroDivisionError"),
        (RecursionError("maximum recursion depth exceeded"), "RecursionError"),
        (struct.error("unpack requires a buffer"), "error"),
        (MemoryError(), "ran out of memory"),
        (Image.DecompressionBombError("too many pixels"), "decompression bomb"),
        (UserWarning("Corrupt EXIF data"), "UserWarning"),
    ],
)
def test_any_exception_while_decoding_is_a_refusal(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, reason: str
) -> None:
    data = png_bytes(1, 1)
    header = probe_image(data, 100)
    monkeypatch.setattr(ImageFile.ImageFile, "load", _raising(error))
    with pytest.raises(MediaRefused, match=reason):
        decode_image(data, header)


def test_a_good_image_decodes_and_carries_its_budget() -> None:
    data = png_bytes(40, 30)
    budget = ImageMemoryBudget(1 << 20)
    image = decode_image(data, probe_image(data, 10_000), budget)
    assert (image.format, image.width, image.height, image.decoded_bytes) == ("PNG", 40, 30, 40 * 30 * 4)
    assert image.budget is budget
    assert image == decode_image(data, probe_image(data, 10_000))  # the budget is not part of its identity


@pytest.mark.anyio
async def test_the_render_holds_its_images_pixels_from_the_budget_while_they_exist() -> None:
    budget = ImageMemoryBudget(1 << 20)
    rgb = png_bytes(40, 30)
    rgba = saved("PNG", "RGBA")
    fetched = [decode_image(data, probe_image(data, 10_000), budget) for data in (rgb, rgba, rgb)]
    seen: list[tuple[int, list[tuple[str, tuple[int, int]]]]] = []

    def render() -> None:
        with decoded_pixels(fetched) as pictures:
            seen.append((budget.held, [(picture.mode, picture.size) for picture in pictures]))

    await anyio.to_thread.run_sync(render)
    assert seen == [(40 * 30 * 4 * 2 + 8 * 8 * 4, [("RGB", (40, 30)), ("RGB", (8, 8)), ("RGB", (40, 30))])]
    assert budget.held == 0


@pytest.mark.anyio
async def test_a_render_that_fails_gives_its_share_back() -> None:
    budget = ImageMemoryBudget(1 << 20)
    data = png_bytes(40, 30)
    good = decode_image(data, probe_image(data, 10_000), budget)
    broken = images.FetchedImage(data=b"junk", digest="0" * 64, format="PNG", width=8, height=8, budget=budget)

    def render() -> None:
        with decoded_pixels([good, broken]):
            pytest.fail("a broken image decoded")

    with pytest.raises(Exception, match="cannot identify image file"):
        await anyio.to_thread.run_sync(render)
    assert budget.held == 0
