"""The access log: one line per HTTP request, written when its response has ended, to the logger `courier.access`.

A line is logfmt (`key=value`, a value with spaces or quotes in double quotes), so a refused request leaves a trace an
operator can grep and a log shipper can parse:

    method=POST path=/v1/chat/completions status=400 ms=3 bytes=182 id=req_5b0e2f9c81d4a7e3f6a1c2d9
    tenant=3fa29c0e1b7d4a55 model=smollm2 trace=4bf92f3577b34da6a3ce929d0e0e4736 error=invalid_request
    param=presence_penalty message="'presence_penalty' must be in [-2, 2]"

What it holds: the method and path (never the query or a header), the status, the milliseconds from the request's
arrival to its last byte (a stream's whole length), the body bytes sent, the request's id (`request_id.py`), the
caller's tenant (a digest of its key; with keys only), the model the request was served by, the request's trace id
(the span in `--trace-file` or the OTLP collector), and, for a status of 400 and above, the error envelope's kind,
parameter and message (its first `MESSAGE_CHARS` characters: the message the client got, which may quote a little
of the value it refuses). A response whose last byte was never sent (the client left, or the request failed without
an answer) says `complete=false`; one never begun, `status=-`. A prompt or a reply is never logged. A websocket is
one line when it closes; a connection `--max-connections` refuses, one line from the connection cap
(`log_refused_connection`).

`/health` and `/metrics` are logged at debug level: a prober's and a scraper's polls would bury the rest.
`--no-access-log` turns the lines off; every request is still counted for `/metrics` (`courier_http_requests_total`,
by route template, method and status: `status/http_requests.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass

import orjson
from opentelemetry import trace

from courier.http.asgi import App, Message, Receive, Scope, Send
from courier.http.request_id import current_request_id
from courier.status.http_requests import HttpRequestCounts

logger = logging.getLogger("courier.access")

ERROR_STATUS = 400
ERROR_BODY_BYTES = 8192  # of an error response, read for its envelope (one is a few hundred bytes)
MESSAGE_CHARS = 300
PATH_CHARS = 512  # of a path (a 404's is whatever the client sent)
SWITCHING_PROTOCOLS = 101  # a websocket accepted
WEBSOCKET_DENIED = 403  # a websocket closed before it was accepted


@dataclass(slots=True)
class RequestNotes:
    """What the application learns of a request that its record reports: the route template it matched, who asked,
    and which model answered."""

    route: str | None = None
    tenant: str | None = None
    model: str | None = None


_NOTES: ContextVar[RequestNotes | None] = ContextVar("courier_access_notes", default=None)


def note_route(route: str) -> None:
    """The request matched this route template (`/v1/responses/<response_id>`)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.route = route


def note_tenant(tenant: str) -> None:
    """The request's caller is this tenant ("" without keys: not reported)."""
    notes = _NOTES.get()
    if notes is not None and tenant:
        notes.tenant = tenant


def note_model(model: str) -> None:
    """The request is served by this model (the first one named, for a request that names several)."""
    notes = _NOTES.get()
    if notes is not None and notes.model is None:
        notes.model = model


class AccessLogMiddleware:
    """An ASGI layer that, when the application is done with a request (a websocket: when the connection ends),
    counts it in `counts` (`/metrics`) and, with `write_lines`, writes its line."""

    def __init__(self, app: App, quiet_paths: Iterable[str], counts: HttpRequestCounts, *, write_lines: bool) -> None:
        self._app = app
        self._quiet = frozenset(quiet_paths)
        self._counts = counts
        self._write_lines = write_lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        started = time.monotonic()
        response = _Response()

        async def sending(message: Message) -> None:
            response.saw(message)
            await send(message)
            response.sent_whole(message)

        notes = RequestNotes()
        token = _NOTES.set(notes)
        try:
            await self._app(scope, receive, sending)
        finally:
            _NOTES.reset(token)
            self._counts.count(notes.route, str(scope.get("method", "GET")), response.status)
            path = str(scope.get("path", ""))
            level = logging.DEBUG if path in self._quiet else logging.INFO
            if self._write_lines and logger.isEnabledFor(level):
                fields = _fields(scope, path, response, notes, time.monotonic() - started)
                logger.log(level, "%s", _line(fields))


def log_refused_connection(head: bytes, answer: bytes, request_id: str, elapsed_s: float) -> None:
    """The line of a request on a connection `--max-connections` refused before the application saw it: its request
    line's method and path (as far as they were read), and the 503 `answer` sent (head and body)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    _, _, body = answer.partition(b"\r\n\r\n")
    fields: list[tuple[str, object]] = [
        ("method", request_line[0] if len(request_line) == 3 else "-"),
        ("path", request_line[1].split("?", 1)[0][:PATH_CHARS] if len(request_line) == 3 else "-"),
        ("status", 503),
        ("ms", round(elapsed_s * 1000)),
        ("bytes", len(body)),
        ("id", request_id),
        *_error_fields(body),
    ]
    logger.info("%s", _line(fields))


@dataclass(slots=True)
class _Response:
    status: int | None = None
    sent: int = 0
    complete: bool = False
    error_body: bytes = b""

    def saw(self, message: Message) -> None:
        kind = message.get("type")
        if kind in ("http.response.start", "websocket.http.response.start"):
            self.status = int(message["status"])
        elif kind in ("http.response.body", "websocket.http.response.body"):
            body = message.get("body", b"")
            self.sent += len(body)
            if (self.status or 0) >= ERROR_STATUS and len(self.error_body) < ERROR_BODY_BYTES:
                self.error_body += bytes(body[: ERROR_BODY_BYTES - len(self.error_body)])
        elif kind == "websocket.accept":
            self.status = SWITCHING_PROTOCOLS
        elif kind == "websocket.send":
            self.sent += len(message.get("bytes") or b"") + len((message.get("text") or "").encode())
        elif kind == "websocket.close" and self.status is None:
            self.status = WEBSOCKET_DENIED  # closed before it was accepted: the server answers 403

    def sent_whole(self, message: Message) -> None:
        """After `message` went out: whether the response has now been sent to its end."""
        kind = message.get("type")
        if (
            kind in ("http.response.body", "websocket.http.response.body") and not message.get("more_body", False)
        ) or kind == "websocket.close":
            self.complete = True


def _fields(
    scope: Scope, path: str, response: _Response, notes: RequestNotes, elapsed_s: float
) -> list[tuple[str, object]]:
    fields: list[tuple[str, object]] = [
        ("method", scope.get("method", "GET")),  # a websocket's scope has none: its upgrade is a GET
        ("path", path[:PATH_CHARS]),
        ("status", response.status if response.status is not None else "-"),
        ("ms", round(elapsed_s * 1000)),
        ("bytes", response.sent),
    ]
    if scope.get("type") == "websocket":
        fields.append(("websocket", "true"))
    elif not response.complete:
        fields.append(("complete", "false"))
    if request_id := current_request_id():
        fields.append(("id", request_id))
    if notes.tenant:
        fields.append(("tenant", notes.tenant))
    if notes.model:
        fields.append(("model", notes.model))
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        fields.append(("trace", f"{context.trace_id:032x}"))
    if response.error_body:
        fields += _error_fields(response.error_body)
    return fields


def _line(fields: Iterable[tuple[str, object]]) -> str:
    return " ".join(f"{key}={_quoted(value)}" for key, value in fields)


def _error_fields(body: bytes) -> list[tuple[str, object]]:
    """The kind, parameter and message of an OpenAI (`{"error": {...}}`) or Anthropic (`{"type": "error", "error":
    {...}}`) error envelope; nothing for a body that is not one."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return []
    fields: list[tuple[str, object]] = []
    kind = error.get("code") or error.get("type")
    if isinstance(kind, str) and kind:
        fields.append(("error", kind))
    if isinstance(error.get("param"), str) and error["param"]:
        fields.append(("param", error["param"]))
    if isinstance(error.get("message"), str):
        message = error["message"]
        fields.append(("message", message if len(message) <= MESSAGE_CHARS else f"{message[:MESSAGE_CHARS]}..."))
    return fields


def _quoted(value: object) -> str:
    """A logfmt value: bare when it has no space, quote, equals sign or control character; else in double quotes,
    with quotes, backslashes and control characters escaped, so one request is always one line."""
    text = str(value)
    if text and not any(char in ' "=\\' or not char.isprintable() for char in text):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = "".join(char if char.isprintable() else _escape(char) for char in escaped)
    return f'"{escaped}"'


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
