"""Snapshot files: one model state on disk, written atomically, checked on every read.

A file is `PREFIX | header | payload`. The prefix holds the magic, the format
version, the header's length, the SHA-256 of the header and of the payload, and an
HMAC-SHA256 of all of those under the directory's key (`snapshot_key`): the MAC
covers header and payload through their digests, and only a server holding the key
can make a file that verifies. The header (JSON) says whose state it is (the model
identity and the store's bucket, session, origin and prompt length), the token
vector's length and digest, how attention KV is stored (quantized or as computed),
the layer layout and every array's dtype, shape and place. The payload is the token
vector (int32, little-endian) and then the arrays' bytes.

Writes go to a temporary name in the same directory (0600), are fsynced, renamed
into place and the directory fsynced: a crash leaves the old state or the new,
never half a file under a real name. Reads check the MAC, both digests, the
identity, the token digest and every declared array against the served model's
layout (`snapshot_layout`) before anything is built from it: a truncated, altered,
forged or foreign file, one of another format version, one stored at other bits or
group size, or one whose state the model could not have, raises `UnreadableSnapshot`
with the reason (the caller deletes it and counts a miss).
Plain files and threads: no MLX here (see `snapshot_codec`).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from courier.core.prompt_cache.entries import DISK_HEADER_ALLOWANCE, Bucket, Origin
from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.prompt_cache.rejections import FileRejection
from courier.engine.prompt_cache.codec import EncodedState
from courier.engine.prompt_cache.layout import LayoutMismatch, StateLayout

MAGIC = b"COURIER-SNAPSHOT"
# 2: the MAC. 3: the header says how attention KV is stored (`quantization`). A format-2 file is read as stored
# as computed; a file of any other version is discarded (counted as `format`), never read on trust.
FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
_QUANTIZATION_SINCE = 3
SUFFIX = ".snap"
TEMPORARY_SUFFIX = ".tmp"
_PREFIX = struct.Struct("<16sII32s32s32s")  # magic, version, header length, header digest, payload digest, MAC
_VERSIONED = struct.Struct("<16sI")  # the part every format version shares
_TOKEN_DTYPE = np.dtype("<i4")  # a token in the file: little-endian int32
_PAYLOAD_DIGEST_AT = 16 + 4 + 4 + 32
_MAC_AT = _PAYLOAD_DIGEST_AT + 32  # the MAC covers every byte of the prefix before it
_WRITE_CHUNK = 8 * 1024**2
_BUCKET_FIELDS = ("model_id", "adapter_id", "template_signature", "media_digest", "tenant")


@dataclass(frozen=True, slots=True)
class FileTrust:
    """What every file of one directory must be: of the served model's identity, MAC'd under the directory's key,
    holding a state of the served model's layout, stored as the server stores it (`quantization`)."""

    identity: str
    key: bytes = field(repr=False)
    layout: StateLayout = field(repr=False)
    quantization: KvQuantization | None = None

    def seal(self, authenticated: bytes) -> bytes:
        return hmac.new(self.key, authenticated, hashlib.sha256).digest()


class UnreadableSnapshot(ValueError):
    """A snapshot file that is truncated, altered, foreign or of another format."""

    def __init__(self, message: str, reason: FileRejection = FileRejection.CORRUPT) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotHeader:
    identity: str
    bucket: Bucket
    session: str
    origin: Origin
    prompt_length: int
    token_count: int
    token_digest: str
    nbytes: int  # the arrays' bytes (what the memory tier is charged)
    layout: Any
    arrays: list[tuple[str, tuple[int, ...], int, int]]  # dtype, shape, offset in the arrays' part, length
    quantization: KvQuantization | None = None  # how attention KV is stored (None: as computed)


@dataclass(slots=True)
class ReadSnapshot:
    """A verified file in memory: its arrays are views into the bytes read. Close it once the state is built."""

    header: SnapshotHeader
    tokens: tuple[int, ...]
    arrays: list[tuple[str, tuple[int, ...], memoryview]]
    _views: list[memoryview]

    def close(self) -> None:
        for view in reversed(self._views):
            view.release()
        self._views.clear()


def write_snapshot(
    path: Path,
    *,
    trust: FileTrust,
    bucket: Bucket,
    session: str,
    origin: Origin,
    prompt_length: int,
    tokens: Sequence[int],
    encoded: EncodedState,
    max_bytes: int,
) -> int:
    """Write the file atomically (temporary name, fsync, rename, directory fsync); returns its size. Raises
    `OSError` (a full disk among them) and `ValueError` when the file would exceed `max_bytes`."""
    token_bytes = _token_bytes(tokens)
    offsets: list[tuple[str, tuple[int, ...], int, int]] = []
    offset = 0
    for blob in encoded.arrays:
        offsets.append((blob.dtype, blob.shape, offset, blob.nbytes))
        offset += blob.nbytes
    header = orjson.dumps(
        {
            "identity": trust.identity,
            "bucket": [getattr(bucket, name) for name in _BUCKET_FIELDS],
            "session": session,
            "origin": origin.value,
            "prompt_length": prompt_length,
            "token_count": len(tokens),
            "token_digest": hashlib.sha256(token_bytes).hexdigest(),
            "nbytes": encoded.nbytes,
            "quantization": trust.quantization.header() if trust.quantization is not None else None,
            "layout": encoded.layout,
            "arrays": [[dtype, list(shape), start, length] for dtype, shape, start, length in offsets],
        }
    )
    if len(header) > DISK_HEADER_ALLOWANCE - _PREFIX.size:
        raise ValueError(f"a snapshot header of {len(header)} bytes is over its {DISK_HEADER_ALLOWANCE}-byte allowance")
    size = _PREFIX.size + len(header) + len(token_bytes) + offset
    if size > max_bytes:
        raise ValueError(f"a snapshot file of {size} bytes is over the {max_bytes} bytes it was charged")
    temporary = path.with_name(f".{path.name}.{os.getpid()}{TEMPORARY_SUFFIX}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            payload_digest = hashlib.sha256()
            header_digest = hashlib.sha256(header).digest()
            file.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), header_digest, bytes(32), bytes(32)))
            file.write(header)
            for part in (memoryview(token_bytes), *(blob.data for blob in encoded.arrays)):
                for start in range(0, part.nbytes, _WRITE_CHUNK):
                    chunk = part[start : start + _WRITE_CHUNK]
                    payload_digest.update(chunk)
                    file.write(chunk)
            prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), header_digest, payload_digest.digest(), bytes(32))
            file.seek(_PAYLOAD_DIGEST_AT)
            file.write(prefix[_PAYLOAD_DIGEST_AT:_MAC_AT] + trust.seal(prefix[:_MAC_AT]))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    with suppress(OSError):
        _fsync_directory(path.parent)  # the file is in place either way; only its durability across a crash waits
    return size


def read_index_entry(path: Path, trust: FileTrust) -> tuple[SnapshotHeader, tuple[int, ...], os.stat_result]:
    """The file's header and token vector, checked (format, MAC, digests, identity, its size against the header),
    without reading its arrays; and the file's status (size, modification time). Only a regular file is opened. The
    arrays are covered by the authenticated payload digest, checked when the file is read back."""
    descriptor, status = _open_regular(path)
    with os.fdopen(descriptor, "rb") as file:
        prefix = file.read(_PREFIX.size)
        length, header_digest, version = _check_prefix(prefix, trust)
        header = _parse_header(file.read(length), header_digest, trust, version)
        token_size = header.token_count * _TOKEN_DTYPE.itemsize
        declared = _PREFIX.size + length + token_size + sum(nbytes for *_, nbytes in header.arrays)
        if declared != status.st_size:  # also bounds the token vector read next by the file's size
            raise UnreadableSnapshot(f"{path.name}: {status.st_size} bytes where its header says {declared}")
        token_bytes = file.read(token_size)
    if hashlib.sha256(token_bytes).hexdigest() != header.token_digest:
        raise UnreadableSnapshot(f"{path.name}: the token vector does not match its digest")
    return header, _tokens(token_bytes), status


def read_snapshot(path: Path, trust: FileTrust, max_bytes: int) -> ReadSnapshot:
    """The whole file, read into memory and verified (MAC, header, payload digest, token digest, array bounds); marked
    used. Only a regular file of at most `max_bytes` (what its entry was charged) is read. Read, not mapped: the MLX
    thread then copies from memory, never waits on the disk, and a failing disk is an `OSError` here rather than a
    fault in whatever thread touched a mapped page."""
    descriptor, status = _open_regular(path)
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        size = status.st_size
        if size < _PREFIX.size:
            raise UnreadableSnapshot(f"{path.name}: truncated ({size} bytes)")
        if size > max_bytes:
            raise UnreadableSnapshot(f"{path.name}: {size} bytes, over the {max_bytes} its entry was charged")
        with suppress(OSError):
            os.utime(descriptor if os.utime in os.supports_fd else path)  # its age after a restart: from last use
        data = bytearray(size)
        _read_exactly(file, data, path)
    whole = memoryview(data)
    views: list[memoryview] = [whole]
    try:
        length, header_digest, version = _check_prefix(bytes(whole[: _PREFIX.size]), trust)
        payload_digest = bytes(whole[_PAYLOAD_DIGEST_AT : _PAYLOAD_DIGEST_AT + 32])
        start = _PREFIX.size + length
        if start > size:
            raise UnreadableSnapshot(f"{path.name}: truncated inside its header")
        header = _parse_header(bytes(whole[_PREFIX.size : start]), header_digest, trust, version)
        payload = whole[start:]
        views.append(payload)
        expected = header.token_count * _TOKEN_DTYPE.itemsize + sum(length for *_, length in header.arrays)
        if payload.nbytes != expected:
            raise UnreadableSnapshot(f"{path.name}: {payload.nbytes} payload bytes where the header says {expected}")
        if hashlib.sha256(payload).digest() != payload_digest:
            raise UnreadableSnapshot(f"{path.name}: the payload does not match its digest")
        token_part = payload[: header.token_count * _TOKEN_DTYPE.itemsize]
        views.append(token_part)
        if hashlib.sha256(token_part).hexdigest() != header.token_digest:
            raise UnreadableSnapshot(f"{path.name}: the token vector does not match its digest")
        tokens = _tokens(token_part)
        arrays_part = payload[header.token_count * _TOKEN_DTYPE.itemsize :]
        views.append(arrays_part)
        arrays: list[tuple[str, tuple[int, ...], memoryview]] = []
        for dtype, shape, offset, nbytes in header.arrays:
            view = arrays_part[offset : offset + nbytes]
            views.append(view)
            arrays.append((dtype, shape, view))
        return ReadSnapshot(header=header, tokens=tokens, arrays=arrays, _views=views)
    except BaseException:
        for view in reversed(views):
            view.release()
        raise


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """A descriptor of `path` and its status, if it is a regular file. Anything else (a directory, a FIFO, which
    would block a plain open forever, a socket, a device, a symbolic link to any of them) is `NOT_A_FILE`: never
    followed, never read."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise UnreadableSnapshot(f"{path.name}: not a regular file", FileRejection.NOT_A_FILE)
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:  # replaced by a symbolic link since
            raise UnreadableSnapshot(f"{path.name}: a symbolic link", FileRejection.NOT_A_FILE) from None
        raise
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):  # replaced since the lstat
        os.close(descriptor)
        raise UnreadableSnapshot(f"{path.name}: not a regular file", FileRejection.NOT_A_FILE)
    return descriptor, status


def _read_exactly(file: Any, data: bytearray, path: Path) -> None:
    """Fill `data` from `file` (one read may return less than asked, e.g. past 2 GiB on Linux)."""
    filled = 0
    with memoryview(data) as target:
        while filled < len(data):
            with target[filled:] as rest:
                count = file.readinto(rest)
            if not count:
                raise UnreadableSnapshot(f"{path.name}: shorter than it was a moment ago")
            filled += count


def _check_prefix(prefix: bytes, trust: FileTrust) -> tuple[int, bytes, int]:
    """The header's length and digest and the format version, once the prefix is of a format this server reads and
    its MAC verifies under the key."""
    if len(prefix) < _VERSIONED.size:
        raise UnreadableSnapshot("truncated before its header")
    magic, version = _VERSIONED.unpack_from(prefix)
    if magic != MAGIC:
        raise UnreadableSnapshot("not a Courier snapshot file")
    if version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise UnreadableSnapshot(f"snapshot format {version}, this server reads {readable}", FileRejection.FORMAT)
    if len(prefix) < _PREFIX.size:
        raise UnreadableSnapshot("truncated before its header")
    _, _, length, header_digest, _, mac = _PREFIX.unpack(prefix)
    if not hmac.compare_digest(mac, trust.seal(prefix[:_MAC_AT])):
        raise UnreadableSnapshot("not written under this directory's key", FileRejection.UNAUTHENTICATED)
    if length > DISK_HEADER_ALLOWANCE:
        raise UnreadableSnapshot(f"a header of {length} bytes")
    return length, header_digest, version


def _parse_header(raw: bytes, digest: bytes, trust: FileTrust, version: int = FORMAT_VERSION) -> SnapshotHeader:
    if hashlib.sha256(raw).digest() != digest:
        raise UnreadableSnapshot("the header does not match its digest")
    try:
        fields = orjson.loads(raw)
        if fields["identity"] != trust.identity:
            raise UnreadableSnapshot("written for another model", FileRejection.FOREIGN)
        # Format 2 predates quantized snapshots: its states are as computed.
        stored = fields["quantization"] if version >= _QUANTIZATION_SINCE else None
        quantization = KvQuantization.from_header(stored)
        if quantization != trust.quantization:
            form = quantization.label if quantization is not None else "as computed"
            raise UnreadableSnapshot(f"attention KV stored {form}, not as this server stores it", FileRejection.FOREIGN)
        bucket_fields = [str(item) for item in fields["bucket"]]
        arrays = [
            (str(dtype), tuple(_count(size) for size in shape), _count(offset), _count(length))
            for dtype, shape, offset, length in fields["arrays"]
        ]
        header = SnapshotHeader(
            identity=fields["identity"],
            bucket=Bucket(*bucket_fields),
            session=str(fields["session"]),
            origin=Origin(fields["origin"]),
            prompt_length=_count(fields["prompt_length"]),
            token_count=_count(fields["token_count"]),
            token_digest=str(fields["token_digest"]),
            nbytes=_count(fields["nbytes"]),
            layout=fields["layout"],
            arrays=arrays,
            quantization=quantization,
        )
    except UnreadableSnapshot:
        raise
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise UnreadableSnapshot(f"a malformed header: {error}") from error
    if header.token_count < 1 or not 0 < header.prompt_length <= header.token_count:
        raise UnreadableSnapshot("a header with an impossible token count")
    try:
        trust.layout.check(header.layout, header.arrays, token_count=header.token_count, nbytes=header.nbytes)
    except LayoutMismatch as mismatch:
        raise UnreadableSnapshot(f"not a state of the served model: {mismatch}", FileRejection.LAYOUT) from None
    return header


def _count(value: Any) -> int:
    """A JSON integer that counts something: never a float, a bool or a string read as one."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{str(value)[:40]} is not a count")
    return value


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """The tokens as the file stores them, little-endian int32 (numpy: a Python loop over a 20K-token agent prompt
    held the GIL ~4 ms per file, three files a turn, beside the next request's tokenizing)."""
    try:
        return np.asarray(tokens, dtype=_TOKEN_DTYPE).tobytes()
    except OverflowError:
        raise ValueError("a token id does not fit the file's 32-bit tokens") from None


def _tokens(token_bytes: bytes | bytearray | memoryview) -> tuple[int, ...]:
    return tuple(np.frombuffer(token_bytes, dtype=_TOKEN_DTYPE).tolist())


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
