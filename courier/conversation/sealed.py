"""Sealed reasoning: a reasoning item's text under authenticated encryption with the server's key.

A client that keeps nothing on the server (`store: false`) and asks for `include: ["reasoning.encrypted_content"]`
(Codex does on every turn) gets each reasoning item with `encrypted_content` set, and sends the item back on its
next turn so the model keeps its reasoning in context. That value is the seal of the reasoning's text: AES-256-GCM
under a key derived from the server's (`--compaction-key-file`, else a key kept in `--data-dir`), so an item this
server did not seal, or one altered since, is refused rather than read (a forged item would put words in the
model's mouth). The text itself is no secret here (the item's `content` carries it in clear, as every Courier
reasoning item does); the seal is what lets a stateless client hand it back trusted.

Format: `crs1.` + unpadded base64url of a 12-byte random nonce, then the ciphertext and its 16-byte tag, of the
JSON `{"text": ...}`, with `crs1` as associated data.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from typing import Any

import orjson
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PREFIX = "crs1."
_ASSOCIATED = b"crs1"
_NONCE_BYTES = 12
_TAG_BYTES = 16
KEY_BYTES = 32
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
# Binds a key derived from a shared secret (the compaction key) to this one use.
_DERIVATION_LABEL = b"courier reasoning seal v1"


class SealError(ValueError):
    """A sealed value that cannot be used; the message says why (for a 400 naming the item)."""


def derived_key(secret: bytes) -> bytes:
    """The sealing key for a server secret used for other things too (the compaction capsule's HMAC key)."""
    return hmac.new(secret, _DERIVATION_LABEL, hashlib.sha256).digest()


class ReasoningSeal:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, text: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, orjson.dumps({"text": text}), _ASSOCIATED)
        return PREFIX + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode("ascii")

    def unseal(self, value: Any) -> str:
        """The text `value` seals; `SealError` when it is not a seal of this server's, or was altered."""
        if not isinstance(value, str) or not value.startswith(PREFIX):
            raise SealError("encrypted_content was not sealed by this server")
        body = value[len(PREFIX) :]
        if not _BASE64URL.fullmatch(body):
            raise SealError("encrypted_content is not base64url")
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise SealError("encrypted_content is not base64url") from None
        if len(raw) < _NONCE_BYTES + _TAG_BYTES:
            raise SealError("encrypted_content is too short to be a seal")
        try:
            plain = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _ASSOCIATED)
        except InvalidTag:
            raise SealError("encrypted_content was not sealed by this server, or was altered") from None
        payload = orjson.loads(plain)
        if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
            raise SealError("encrypted_content does not hold reasoning text")
        return str(payload["text"])
