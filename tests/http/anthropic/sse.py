"""Reading a Messages API stream as its events, and checking their order as Anthropic defines it."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson

Event = tuple[str, dict[str, Any]]
# The order of a message's events, pings aside: each block opens, takes deltas and closes before the next opens.
ORDER = re.compile(
    r"message_start (content_block_start (content_block_delta )+content_block_stop )*message_delta message_stop"
)


def read_events(response: httpx.Response) -> list[Event]:
    """Each event's name and data, in order (the data's `type` checked against the name)."""
    events: list[Event] = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = orjson.loads(line.removeprefix("data: "))
            assert name is not None and data["type"] == name, (name, data)
            events.append((name, data))
    return events


def check_order(events: list[Event]) -> list[Event]:
    """Assert Anthropic's order (pings anywhere after `message_start`, blocks numbered from 0 in order, each
    delta of its block's kind) and return the events without the pings."""
    assert events and events[0][0] == "message_start", events[:1]
    kept = [(name, data) for name, data in events if name != "ping"]
    assert ORDER.fullmatch(" ".join(name for name, _ in kept)), [name for name, _ in kept]
    opened: dict[int, str] = {}
    for name, data in kept:
        if name == "content_block_start":
            assert data["index"] == len(opened)
            opened[data["index"]] = data["content_block"]["type"]
        elif name == "content_block_delta":
            kind = {
                "text_delta": "text",
                "thinking_delta": "thinking",
                "signature_delta": "thinking",
                "input_json_delta": "tool_use",
            }
            assert kind[data["delta"]["type"]] == opened[data["index"]]
        elif name == "content_block_stop":
            assert data["index"] == len(opened) - 1
    return kept
