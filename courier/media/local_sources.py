"""Image bytes that need no network: `data:` URIs, and `file://` paths confined under `--media-path`.

A `data:` URI must be a base64 image (`urls.data_uri`). A `file://` URL is refused
without a media root. With one, its path is joined under the root: no `..`
segment, no percent-encoded separator, dot or NUL, no symlink leading outside the
root, and only a regular file is read.
"""

from __future__ import annotations

import binascii
import re
from pathlib import Path
from urllib.parse import unquote

from courier.media.address_policy import MediaRefused
from courier.media.urls import data_uri, file_url

_ENCODED_SEPARATOR = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)


def data_uri_bytes(url: str, max_bytes: int) -> bytes:
    """`data:image/<type>;base64,<data>` -> bytes, refusing more than `max_bytes` before decoding anything."""
    parsed = data_uri(url)
    if (len(url) - parsed.payload_start) * 3 // 4 > max_bytes + 2:
        raise MediaRefused(f"the data: URI holds more than --max-image-bytes ({max_bytes} bytes)")
    try:
        data = binascii.a2b_base64(url[parsed.payload_start :], strict_mode=True)
    except (binascii.Error, ValueError):
        raise MediaRefused("the data: URI's payload is not valid base64") from None
    if len(data) > max_bytes:
        raise MediaRefused(f"the data: URI holds more than --max-image-bytes ({max_bytes} bytes)")
    return data


def confined_path(root: Path | None, url: str) -> Path:
    """The file a `file://` URL names under `root`, or `MediaRefused`."""
    if root is None:
        raise MediaRefused("file:// URLs are refused: the server has no --media-path")
    path = file_url(url).path
    if _ENCODED_SEPARATOR.search(path):
        raise MediaRefused("percent-encoded separators, dots or NUL are refused in file:// paths")
    relative = unquote(path).lstrip("/")
    segments = relative.split("/")
    if not relative or any(segment in ("..", ".") for segment in segments) or "\\" in relative:
        raise MediaRefused("the file:// path must name a file under --media-path without '.' or '..' segments")
    base = root.resolve()
    try:
        resolved = (base / relative).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):  # ValueError: a name the OS cannot take (file_url refuses NUL)
        raise MediaRefused(f"no such file under --media-path: {relative[:256]}") from None
    if not resolved.is_relative_to(base):
        raise MediaRefused("the file:// path leads outside --media-path")
    if not resolved.is_file():
        raise MediaRefused("the file:// path is not a regular file")
    return resolved


def read_confined(path: Path, max_bytes: int) -> bytes:
    try:
        with path.open("rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as error:  # removed or made unreadable since it was found
        raise MediaRefused(f"the file cannot be read: {error.strerror or type(error).__name__}") from None
    if len(data) > max_bytes:
        raise MediaRefused(f"the file is larger than --max-image-bytes ({max_bytes} bytes)")
    return data
