"""Server-sent events of a streamed response: `event:` and `data:` lines, each with the next `sequence_number`."""

from __future__ import annotations

from typing import Any

import orjson

from courier.http.errors import ApiError


class EventWriter:
    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def error(self, error: ApiError) -> bytes:
        """The `error` event: a failure outside the response's own lifecycle (it could not even fail cleanly)."""
        return self("error", code=error.code or error.error_type, message=error.message, param=error.param)
