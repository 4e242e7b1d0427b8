"""Events of a streamed response, each with the next `sequence_number`: `event:` and `data:` lines (server-sent
events), or one JSON text each (the Responses WebSocket, which echoes the request's `stream_id` in every event)."""

from __future__ import annotations

from typing import Any

import orjson

from courier.http.errors import ApiError
from courier.http.sse import sse_event


class EventWriter:
    def __init__(self, *, json_frames: bool = False, stream_id: str | None = None) -> None:
        self._sequence = 0
        self._json_frames = json_frames
        self._stream_id = stream_id

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        if self._stream_id is not None:
            payload["stream_id"] = self._stream_id
        if self._json_frames:
            return orjson.dumps(payload)
        return sse_event(kind, payload)

    def error(self, error: ApiError) -> bytes:
        """The `error` event: a failure outside the response's own lifecycle (it could not even fail cleanly)."""
        return self("error", code=error.code or error.error_type, message=error.message, param=error.param)
