"""A streamed message as Anthropic's server-sent events, in Anthropic's order. `message_start`, then per content block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`; an omitted thinking block's one
`signature_delta`) and `content_block_stop`, blocks numbered from 0 in the order they open; then `message_delta`
(`stop_reason`, `stop_sequence`, the final usage) and `message_stop`. `ping` may come anywhere after `message_start`
(sent while the stream would otherwise be silent); a failure after the first byte is one `error` event, and the stream
ends there. Whitespace that would open a text block is held until text that is not whitespace follows, so a reply of
only calls has no empty text block. Pure: bytes in, bytes out.
"""

from __future__ import annotations

from typing import Any

import orjson

from courier.http.anthropic.message import text_block, thinking_block
from courier.http.errors import ApiError
from courier.http.sse import sse_event
from courier.storage.records import JsonObject


def event(kind: str, payload: JsonObject) -> bytes:
    return sse_event(kind, {"type": kind, **payload})


def ping() -> bytes:
    return event("ping", {})


def error_event(error: ApiError) -> bytes:
    return event("error", {key: value for key, value in error.anthropic_body().items() if key != "type"})


class MessageEvents:
    """The events of one message, block by block."""

    def __init__(self, *, thinking_shown: bool = True) -> None:
        self._thinking_shown = thinking_shown  # False (`display: "omitted"`): a thinking block carries no text
        self._index = -1
        self._open: str | None = None  # the type of the block now open
        self._held_space = ""

    def start(self, message: JsonObject) -> bytes:
        return event("message_start", {"message": message})

    def thinking(self, text: str) -> list[bytes]:
        if not text:
            return []
        opened = self._open_block("thinking", thinking_block(""))
        if not self._thinking_shown:  # the block and its signature, as Anthropic streams an omitted one
            return [*opened, self._delta("signature_delta", signature="")] if opened else []
        return [*opened, self._delta("thinking_delta", thinking=text)]

    def text(self, text: str) -> list[bytes]:
        if self._open != "text" and not text.strip():
            self._held_space += text
            return []
        text, self._held_space = self._held_space + text, ""
        return [*self._open_block("text", text_block("")), self._delta("text_delta", text=text)]

    def tool_use(self, block: JsonObject) -> list[bytes]:
        """A whole call: its block opens with `input: {}` and its input arrives as one JSON delta."""
        opened = self._open_block("tool_use", {**block, "input": {}})
        arguments = orjson.dumps(block["input"]).decode()
        return [*opened, self._delta("input_json_delta", partial_json=arguments), *self._close()]

    def finish(self, stop_reason: str, stop_sequence: str | None, usage: JsonObject) -> list[bytes]:
        delta = event(
            "message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}
        )
        return [*self._close(), delta, event("message_stop", {})]

    def _open_block(self, kind: str, block: JsonObject) -> list[bytes]:
        if self._open == kind:
            return []
        closed = self._close()
        self._index += 1
        self._open = kind
        return [*closed, event("content_block_start", {"index": self._index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", {"index": self._index})]

    def _delta(self, kind: str, **fields: Any) -> bytes:
        return event("content_block_delta", {"index": self._index, "delta": {"type": kind, **fields}})
