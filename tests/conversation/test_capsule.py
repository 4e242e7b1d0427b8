"""Compaction capsules: round trips, and every way a capsule is refused."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from courier.conversation.capsule import Capsule, CapsuleCodec, CapsuleError, item_digest

KEY = b"k" * 32
CAPSULE = Capsule(
    summary="Ada plans a trip to Lisbon.",
    retained=(item_digest({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}),),
)


def raw(payload: Any) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(payload)).rstrip(b"=").decode()


def test_round_trip_without_a_key_is_readable_base64url_json() -> None:
    codec = CapsuleCodec(None, 10_000)
    encoded = codec.encode(CAPSULE)
    assert "=" not in encoded and "+" not in encoded and "/" not in encoded
    payload = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    assert payload == {"v": 1, "summary": CAPSULE.summary, "retained": list(CAPSULE.retained)}
    assert codec.decode(encoded) == CAPSULE


def test_round_trip_with_a_key_carries_a_mac() -> None:
    codec = CapsuleCodec(KEY, 10_000)
    encoded = codec.encode(CAPSULE)
    assert "mac" in orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    assert codec.decode(encoded) == CAPSULE
    assert CapsuleCodec(None, 10_000).decode(encoded) == CAPSULE  # a keyless server reads it, unverified


def altered(encoded: str) -> str:
    payload = orjson.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
    payload["summary"] = "Ada plans a trip to Porto."
    return raw(payload)


SIGNED = CapsuleCodec(KEY, 10_000).encode(CAPSULE)
REFUSED: list[tuple[str, Any, str]] = [
    ("not base64url", "!!!not base64!!!", "base64url"),
    ("whitespace inside", " ".join(raw({"v": 1, "summary": "s", "retained": []})), "base64url"),
    ("the standard alphabet", base64.b64encode(b"\xfb\xff" + orjson.dumps({"v": 1})).decode(), "base64url"),
    ("not JSON", base64.urlsafe_b64encode(b"hello there").decode(), "JSON"),
    ("not an object", raw([1, 2]), "object"),
    ("version 2", raw({"v": 2, "summary": "s", "retained": []}), "version"),
    ("version true", raw({"v": True, "summary": "s", "retained": []}), "version"),
    ("version 1.0", raw({"v": 1.0, "summary": "s", "retained": []}), "version"),
    ("version '1'", raw({"v": "1", "summary": "s", "retained": []}), "version"),
    ("no summary", raw({"v": 1, "retained": []}), "summary"),
    (
        "nested capsule",
        raw({"v": 1, "summary": "s", "retained": [{"type": "compaction", "encrypted_content": "x"}]}),
        "another capsule",
    ),
    ("retained not digests", raw({"v": 1, "summary": "s", "retained": ["short"]}), "digests"),
    ("unsigned", CapsuleCodec(None, 10_000).encode(CAPSULE), "not made by this server"),
    ("altered", altered(SIGNED), "not made by this server"),
    ("another server's", CapsuleCodec(b"x" * 32, 10_000).encode(CAPSULE), "not made by this server"),
    ("empty", "", "non-empty"),
    ("not a string", 42, "non-empty"),
]


@pytest.mark.parametrize(("case", "encoded", "reason"), REFUSED, ids=[case for case, _, _ in REFUSED])
def test_refused(case: str, encoded: Any, reason: str) -> None:
    with pytest.raises(CapsuleError, match=reason):
        CapsuleCodec(KEY, 10_000).decode(encoded)


def test_a_capsule_over_the_body_limit_is_refused() -> None:
    codec = CapsuleCodec(None, 100)
    with pytest.raises(CapsuleError, match="body limit"):
        codec.decode(codec.encode(Capsule(summary="x" * 200, retained=())))


def test_digests_ignore_ids_and_status_but_not_content() -> None:
    message = {
        "id": "msg_1",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_text", "text": "Hi"}],
    }
    same = {**message, "id": "msg_2", "status": "incomplete"}
    other = {**message, "content": [{"type": "input_text", "text": "Hello"}]}
    assert item_digest(message) == item_digest(same)
    assert item_digest(message) != item_digest(other)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert item_digest(call) != item_digest({**call, "arguments": '{"a": 1}'})
