"""Replaying a compacted history: summary and retained items in place of what the capsule covers."""

from __future__ import annotations

from typing import Any

import pytest

from courier.conversation.capsule import Capsule, CapsuleCodec, CapsuleError, item_digest
from courier.conversation.replay import SUMMARY_HEADER, expand

CODEC = CapsuleCodec(None, 100_000)


def message(role: str, text: str, item_id: str = "") -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": item_id or f"msg_{text}", "type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def capsule(summary: str, retained: list[dict[str, Any]]) -> dict[str, Any]:
    encoded = CODEC.encode(Capsule(summary=summary, retained=tuple(item_digest(item) for item in retained)))
    return {"id": "cmp_1", "type": "compaction", "encrypted_content": encoded}


def shown(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(item["role"], item["content"][0]["text"]) for item in items]


def test_the_capsule_replaces_what_it_covers_with_summary_and_retained_items() -> None:
    system = message("system", "Be brief.")
    old = [message("user", "old question"), message("assistant", "old answer")]
    kept = message("user", "kept question")
    replay = [system, kept, capsule("They talked.", [kept]), message("user", "new question")]
    assert shown(expand([*old, *replay], CODEC, None)) == [
        ("system", "Be brief."),
        ("assistant", SUMMARY_HEADER + "They talked."),
        ("user", "kept question"),
        ("user", "new question"),
    ]


def test_retained_items_appear_once_even_when_sent_twice() -> None:
    kept = message("user", "kept", "msg_a")
    again = message("user", "kept", "msg_b")  # a replay gives it a fresh id
    items = [kept, again, capsule("s", [kept])]
    assert shown(expand(items, CODEC, None)) == [("assistant", SUMMARY_HEADER + "s"), ("user", "kept")]


def test_two_retained_items_that_say_the_same_thing_both_stay() -> None:
    first, reply, again = (
        message("user", "Go on.", "msg_1"),
        message("assistant", "Done."),
        message("user", "Go on.", "msg_2"),
    )
    items = [first, reply, again, capsule("s", [first, reply, again])]
    assert shown(expand(items, CODEC, None)) == [
        ("assistant", SUMMARY_HEADER + "s"),
        ("user", "Go on."),
        ("assistant", "Done."),
        ("user", "Go on."),
    ]


def test_repeated_system_messages_and_instructions_are_kept_once() -> None:
    items = [
        message("system", "Rules."),
        message("developer", "Dev."),
        message("system", "Rules."),
        message("system", "Be brief."),
    ]
    assert shown(expand(items, CODEC, "Be brief.")) == [("system", "Rules."), ("developer", "Dev.")]


def test_only_the_newest_capsule_counts() -> None:
    first = capsule("first summary", [])
    second = capsule("second summary", [])
    items = [message("user", "a"), first, message("user", "b"), second, message("user", "c")]
    assert shown(expand(items, CODEC, None)) == [("assistant", SUMMARY_HEADER + "second summary"), ("user", "c")]


def test_a_bad_capsule_is_an_error() -> None:
    with pytest.raises(CapsuleError):
        expand([{"id": "cmp_x", "type": "compaction", "encrypted_content": "!!!"}], CODEC, None)
