"""data: URIs and file:// paths confined under --media-path."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from courier.media.address_policy import MediaRefused
from courier.media.local_sources import confined_path, data_uri_bytes


def test_data_uris_decode_and_respect_the_byte_cap() -> None:
    payload = base64.b64encode(b"\x89PNG-bytes").decode()
    assert data_uri_bytes(f"data:image/png;base64,{payload}", 100) == b"\x89PNG-bytes"
    exactly = base64.b64encode(b"x" * 100).decode()
    assert len(data_uri_bytes(f"data:image/png;base64,{exactly}", 100)) == 100
    with pytest.raises(MediaRefused, match="max-image-bytes"):
        data_uri_bytes(f"data:image/png;base64,{base64.b64encode(b'x' * 101).decode()}", 100)
    with pytest.raises(MediaRefused, match="base64"):
        data_uri_bytes("data:image/png;base64,@@@", 100)
    with pytest.raises(MediaRefused, match="','"):
        data_uri_bytes("data:image/png;base64", 100)
    with pytest.raises(MediaRefused, match="data:image/<type>;base64"):  # only base64 images
        data_uri_bytes("data:text/plain,hello%20there", 100)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    (media / "cats").mkdir(parents=True)
    (media / "cats" / "tom.png").write_bytes(b"png")
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", media / "escape.png")
    os.symlink(media / "cats" / "tom.png", media / "alias.png")
    (media / "fifo").mkdir()
    return media


def test_a_file_under_the_root_is_found(root: Path) -> None:
    assert confined_path(root, "file:///cats/tom.png") == (root / "cats" / "tom.png").resolve()
    assert confined_path(root, "file://localhost/cats/tom.png") == (root / "cats" / "tom.png").resolve()
    assert confined_path(root, "file:///alias.png") == (root / "cats" / "tom.png").resolve()  # a symlink inside


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("file:///../secret.txt", "'..'"),
        ("file:///cats/../../secret.txt", "'..'"),
        ("file:///cats/./tom.png", "'..'"),
        ("file:///cats%2ftom.png", "percent-encoded"),
        ("file:///cats%2Ftom.png", "percent-encoded"),
        ("file:///%2e%2e/secret.txt", "percent-encoded"),
        ("file:///cats%5ctom.png", "percent-encoded"),
        ("file:///cats/tom.png%00.jpg", "NUL"),
        ("file:///cats/tom.png\x00.jpg", "NUL"),
        ("file:///cats/\x00", "NUL"),
        ("file:///cats\\..\\..\\secret.txt", "'..'"),
        ("file:///escape.png", "outside"),
        ("file:///fifo", "not a regular file"),
        ("file:///cats/missing.png", "no such file"),
        ("file://otherhost/cats/tom.png", "no host"),
        ("file:///", "'..'"),
    ],
)
def test_traversal_and_escapes_are_refused(root: Path, url: str, reason: str) -> None:
    with pytest.raises(MediaRefused, match=reason):
        confined_path(root, url)


def test_file_urls_need_a_media_root() -> None:
    with pytest.raises(MediaRefused, match="--media-path"):
        confined_path(None, "file:///cats/tom.png")
