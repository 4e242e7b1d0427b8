"""Every HTTP request's id (a websocket's too), on its response and wherever the request is reported: what a user
quotes and an operator greps.

The id is `req_` and 24 hex digits, minted for the request, or the `X-Request-Id` the request came with when that is
1-128 characters of letters, digits and `._:-` (a front such as HAProxy or nginx that numbers requests, so its log
and the replica's agree; of several such headers, the last); anything else in that header is ignored and an id
minted. A client talking to the server directly may name its own id too: an id is for finding a request, never
for authorizing anything. It is sent back as
`x-request-id` (what OpenAI's SDKs read: `_request_id`, `APIStatusError.request_id`) and as `request-id` (what
Anthropic's read), carried in an Anthropic error body's `request_id`, set on the request's span
(`courier.request_id`) and written in its access-log line (`id=`).
"""

from __future__ import annotations

import re
import secrets
from contextvars import ContextVar

from opentelemetry import trace

from courier.http.asgi import App, Message, Receive, Scope, Send
from courier.runtime import trace_attributes

PREFIX = "req_"
RANDOM_BYTES = 12
GIVEN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_HEADER = b"x-request-id"
RESPONSE_HEADERS = (b"x-request-id", b"request-id")
# The messages that begin an answer and carry its headers: an HTTP response, a websocket's acceptance or refusal.
_ANSWER_STARTS = frozenset({"http.response.start", "websocket.accept", "websocket.http.response.start"})


_CURRENT: ContextVar[str | None] = ContextVar("courier_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the HTTP request being handled (None outside one)."""
    return _CURRENT.get()


def mint() -> str:
    return f"{PREFIX}{secrets.token_hex(RANDOM_BYTES)}"


class RequestIdMiddleware:
    """An ASGI layer that gives each HTTP request its id and puts it on the response's headers."""

    def __init__(self, app: App) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        request_id = _given(scope) or mint()
        trace.get_current_span().set_attribute(trace_attributes.REQUEST_ID, request_id)
        encoded = request_id.encode("ascii")

        async def sending(message: Message) -> None:
            if message.get("type") in _ANSWER_STARTS:
                kept = [
                    (key, value) for key, value in message.get("headers", ()) if key.lower() not in RESPONSE_HEADERS
                ]
                message = {**message, "headers": [*kept, *((header, encoded) for header in RESPONSE_HEADERS)]}
            await send(message)

        token = _CURRENT.set(request_id)
        try:
            await self._app(scope, receive, sending)
        finally:
            _CURRENT.reset(token)


def _given(scope: Scope) -> str | None:
    """The request's own `X-Request-Id`, when sane; of several, the last (a front appends its own)."""
    given = [value for key, value in scope.get("headers", ()) if key.lower() == REQUEST_HEADER]
    text = given[-1].decode("latin-1").strip() if given else ""
    return text if GIVEN.fullmatch(text) else None
