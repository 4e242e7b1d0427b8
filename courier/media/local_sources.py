"""Image bytes that need no network: `data:` URIs, and `file://` paths confined under `--media-path`.

A `file://` URL is refused without a media root. With one, its path is joined
under the root: no `..` segment, no percent-encoded separator or dot, no symlink
leading outside the root, and only a regular file is read.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from courier.media.address_policy import MediaRefused

_ENCODED_SEPARATOR = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)


def data_uri_bytes(url: str, max_bytes: int) -> bytes:
    """`data:[<media type>][;base64],<data>` -> bytes, refusing more than `max_bytes`."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaRefused("a data: URI needs a ',' before its data")
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise MediaRefused(f"the data: URI holds more than --max-image-bytes ({max_bytes} bytes)")
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused("the data: URI is not valid base64") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaRefused(f"the data: URI holds more than --max-image-bytes ({max_bytes} bytes)")
    return data


def confined_path(root: Path | None, url: str) -> Path:
    """The file a `file://` URL names under `root`, or `MediaRefused`."""
    if root is None:
        raise MediaRefused("file:// URLs are refused: the server has no --media-path")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaRefused("file:// URLs name no host (file:///path)")
    if _ENCODED_SEPARATOR.search(parts.path):
        raise MediaRefused("percent-encoded separators, dots or NUL are refused in file:// paths")
    relative = unquote(parts.path).lstrip("/")
    segments = relative.split("/")
    if not relative or any(segment in ("..", ".") for segment in segments) or "\\" in relative:
        raise MediaRefused("the file:// path must name a file under --media-path without '.' or '..' segments")
    base = root.resolve()
    try:
        resolved = (base / relative).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaRefused(f"no such file under --media-path: {relative}") from None
    if not resolved.is_relative_to(base):
        raise MediaRefused("the file:// path leads outside --media-path")
    if not resolved.is_file():
        raise MediaRefused("the file:// path is not a regular file")
    return resolved


def read_confined(path: Path, max_bytes: int) -> bytes:
    with path.open("rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise MediaRefused(f"the file is larger than --max-image-bytes ({max_bytes} bytes)")
    return data
