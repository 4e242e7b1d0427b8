"""The stream writer emits Anthropic's events in Anthropic's order: asserted as exact sequences."""

from __future__ import annotations

from typing import Any

import orjson

from courier.core.failure_codes import FailureCode
from courier.core.tools.calls import ToolCall
from courier.http.anthropic.events import MessageEvents, error_event, ping
from courier.http.anthropic.message import tool_use_block
from courier.http.errors import ApiError

USAGE = {"input_tokens": 1, "output_tokens": 2}


def decode(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    """Each event as (its `event:` name, its data); the data's `type` is always the event's name."""
    events = []
    for chunk in chunks:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        name, payload = head.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        events.append((name, payload))
    return events


def test_thinking_then_text_then_a_call() -> None:
    writer = MessageEvents()
    chunks = [writer.start({"id": "msg_1"})]
    chunks += writer.thinking("Let me ")
    chunks += writer.thinking("think.")
    chunks += writer.text("\n")  # whitespace alone opens no block
    chunks += writer.text("Calling.")
    chunks.append(ping())
    chunks += writer.tool_use(tool_use_block(ToolCall(id="call_abc", name="f", arguments='{"x": 1}')))
    chunks += writer.finish("tool_use", None, USAGE)
    assert decode(chunks) == [
        ("message_start", {"type": "message_start", "message": {"id": "msg_1"}}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Let me "}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "think."}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "\nCalling."}},
        ),
        ("ping", {"type": "ping"}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 2,
                "content_block": {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": '{"x":1}'},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": USAGE},
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_a_reply_of_only_whitespace_and_calls_has_no_text_block() -> None:
    writer = MessageEvents()
    chunks = [*writer.text("\n"), *writer.text("  ")]
    chunks += writer.tool_use(tool_use_block(ToolCall(id="call_1", name="f", arguments="{}")))
    chunks += writer.tool_use(tool_use_block(ToolCall(id="call_2", name="g", arguments="not json")))
    names = [(name, payload.get("index")) for name, payload in decode(chunks)]
    assert names == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]
    assert decode(chunks)[4][1]["delta"]["partial_json"] == "{}"  # arguments that are no JSON object: {}


def test_an_empty_reply_is_start_delta_stop() -> None:
    writer = MessageEvents()
    assert [name for name, _ in decode(writer.finish("end_turn", None, USAGE))] == ["message_delta", "message_stop"]


def test_a_failure_is_one_error_event_in_anthropics_envelope() -> None:
    failure = ApiError(503, "the server is shutting down", code=FailureCode.SHUTTING_DOWN)
    ((name, payload),) = decode([error_event(failure)])
    assert name == "error"
    assert payload["error"]["type"] == "overloaded_error"
    assert payload["error"]["message"] == "the server is shutting down"
