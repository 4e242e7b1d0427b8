"""The compaction capsule: what a `{type: "compaction"}` item's `encrypted_content` carries.

`encrypted_content` is the base64url (unpadded) of the JSON object
`{"v": 1, "summary": str, "retained": [digest, ...]}`. The retained items travel
once, as plain items in front of the capsule; the capsule names them only by
digest (`item_digest`), so a replay body carries each of them exactly once.

It is **not encrypted**: anyone holding it can read the summary. With a server key
(`--compaction-key-file`) every capsule also carries `"mac"`, an HMAC-SHA256 of
the rest under that key, and a capsule without a valid one (tampered with, or
made by another server) is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from courier.conversation.items import image_urls, message_text, reasoning_text

CAPSULE_VERSION = 1
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+={0,2}")
_DIGEST_LENGTH = 32


@dataclass(frozen=True, slots=True, kw_only=True)
class Capsule:
    summary: str
    retained: tuple[str, ...]  # digests of the retained items, in order


class CapsuleError(ValueError):
    """A capsule that cannot be used; the message says why (for a 400 naming the item)."""


def item_digest(item: Mapping[str, Any]) -> str:
    """What identifies an item across replays: its content, not its (freshly assigned) id or status."""
    kind = item.get("type")
    if kind == "message":
        key: tuple[Any, ...] = ("message", item["role"], message_text(item), *image_urls(item))
    elif kind == "function_call":
        key = ("function_call", item["call_id"], item["name"], item["arguments"])
    elif kind == "custom_tool_call":
        key = ("custom_tool_call", item["call_id"], item["name"], item["input"])
    elif kind in ("function_call_output", "custom_tool_call_output"):
        key = (kind, item["call_id"], item["output"])
    elif kind == "reasoning":
        key = ("reasoning", reasoning_text(item))
    else:
        key = (str(kind), orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode())
    return hashlib.sha256(orjson.dumps(key)).hexdigest()[:_DIGEST_LENGTH]


class CapsuleCodec:
    def __init__(self, key: bytes | None, max_bytes: int) -> None:
        self._key = key
        self._max_bytes = max_bytes

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def encode(self, capsule: Capsule) -> str:
        payload: dict[str, Any] = {"v": CAPSULE_VERSION, "summary": capsule.summary, "retained": list(capsule.retained)}
        if self._key is not None:
            payload["mac"] = self._mac(payload)
        raw = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    def decode(self, text: Any) -> Capsule:
        if not isinstance(text, str) or not text:
            raise CapsuleError("encrypted_content must be a non-empty string")
        if len(text) > self._max_bytes:
            raise CapsuleError(f"the capsule is over the body limit of {self._max_bytes} bytes")
        if not _BASE64URL.fullmatch(text):  # the decoder would skip stray characters; a capsule has none
            raise CapsuleError("encrypted_content is not base64url")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise CapsuleError("encrypted_content is not base64url") from None
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise CapsuleError("encrypted_content does not hold JSON") from None
        if not isinstance(payload, dict):
            raise CapsuleError("encrypted_content does not hold a JSON object")
        version = payload.get("v")
        if type(version) is not int or version != CAPSULE_VERSION:  # not `true`, not 1.0
            raise CapsuleError(
                f"unsupported capsule version {payload.get('v')!r}: this server reads version {CAPSULE_VERSION}, "
                "a JSON integer"
            )
        summary, retained = payload.get("summary"), payload.get("retained")
        if not isinstance(summary, str) or not isinstance(retained, list):
            raise CapsuleError("a capsule needs a string 'summary' and a list 'retained'")
        if any(isinstance(entry, dict) and entry.get("type") == "compaction" for entry in retained):
            raise CapsuleError("a capsule cannot hold another capsule")
        if not all(isinstance(entry, str) and len(entry) == _DIGEST_LENGTH for entry in retained):
            raise CapsuleError("'retained' must list item digests")
        if self._key is not None:
            mac = payload.pop("mac", None)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(payload)):
                raise CapsuleError("the capsule was not made by this server, or was altered")
        return Capsule(summary=summary, retained=tuple(retained))

    def _mac(self, payload: Mapping[str, Any]) -> str:
        assert self._key is not None
        unsigned = orjson.dumps(
            {key: value for key, value in payload.items() if key != "mac"}, option=orjson.OPT_SORT_KEYS
        )
        return hmac.new(self._key, unsigned, hashlib.sha256).hexdigest()
