"""Snapshot files as an attacker makes them: taken apart, altered and put back together with every digest recomputed.

Written from the format as docs/prompt-cache.md describes it, not from the server's code: prefix (magic, version,
header length, SHA-256 of the header and of the payload, then since version 2 an HMAC-SHA256 of those), JSON header
(since version 3 with a `quantization` field), payload (the int32 token vector, then the arrays' bytes).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

MAGIC = b"COURIER-SNAPSHOT"
PREFIX = struct.Struct("<16sII32s32s32s")
VERSION_1_PREFIX = struct.Struct("<16sII32s32s")
CURRENT_VERSION = 3
TOKEN = struct.Struct("<i")
MAC_AT = PREFIX.size - 32


@dataclass(slots=True)
class SnapshotParts:
    header: dict[str, Any]
    tokens: list[int]
    arrays: bytes  # the payload after the token vector

    @property
    def session(self) -> str:
        return str(self.header["session"])


def take_apart(path: Path) -> SnapshotParts:
    """A version 2 or 3 file's header, token vector and arrays (nothing is checked)."""
    data = path.read_bytes()
    _, _, length, *_ = PREFIX.unpack_from(data)
    header = orjson.loads(data[PREFIX.size : PREFIX.size + length])
    token_end = PREFIX.size + length + header["token_count"] * TOKEN.size
    tokens = [value for (value,) in TOKEN.iter_unpack(data[PREFIX.size + length : token_end])]
    return SnapshotParts(header=header, tokens=tokens, arrays=data[token_end:])


def put_together(parts: SnapshotParts, *, key: bytes | None = None, version: int = CURRENT_VERSION) -> bytes:
    """The file of `parts`, its token count and every digest recomputed; MAC'd with `key` (a random key of the
    attacker's own when None). Version 1: the format before the MAC; 2: before the header's `quantization`."""
    token_bytes = b"".join(TOKEN.pack(token) for token in parts.tokens)
    header = orjson.dumps(
        {**parts.header, "token_count": len(parts.tokens), "token_digest": hashlib.sha256(token_bytes).hexdigest()}
    )
    payload = token_bytes + parts.arrays
    digests = (hashlib.sha256(header).digest(), hashlib.sha256(payload).digest())
    if version == 1:
        return VERSION_1_PREFIX.pack(MAGIC, 1, len(header), *digests) + header + payload
    authenticated = PREFIX.pack(MAGIC, version, len(header), *digests, bytes(32))[:MAC_AT]
    mac = hmac.new(key if key is not None else os.urandom(32), authenticated, hashlib.sha256).digest()
    return authenticated + mac + header + payload


def with_wrapping_keys(parts: SnapshotParts) -> SnapshotParts:
    """The first attention layer's keys declared [65536]*4 with 0 bytes (numpy's int64 product of that shape wraps
    to 0): their bytes taken out of the payload and the arrays after them moved up, so every size adds up."""
    arrays = parts.header["arrays"]
    (index, *_) = [
        layer["state"]["list"][0]["array"] for layer in parts.header["layout"] if layer["class"] == "KVCache"
    ]
    dtype, _, offset, length = arrays[index]
    arrays[index] = [dtype, [65536] * 4, offset, 0]
    for later in arrays[index + 1 :]:
        later[2] -= length
    parts.arrays = parts.arrays[:offset] + parts.arrays[offset + length :]
    parts.header["nbytes"] -= length
    return parts
