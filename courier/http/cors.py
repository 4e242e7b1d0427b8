"""CORS for browser UIs (`--cors-allow-origins`): which origins may read the answers, and the ASGI layer adding it.

`CorsPolicy` is pure: it parses the setting and says which headers an answer to a given `Origin` carries.
`CorsMiddleware` wraps the Quart app, so every answer gets them: JSON bodies, SSE streams (the headers ride on
the response start, before the first event), error envelopes, and the app's own 401/404/405/413. An origin not
in the list gets no CORS headers, so the browser keeps the answer from the page.

A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) from an allowed origin is answered here,
204, before the app sees it: browsers send preflights without the `Authorization` header, so the API-key check
must not run on them. Any other `OPTIONS` goes to the app as before (and needs a key where keys are set).
No `Access-Control-Allow-Credentials`: clients send a bearer key, never cookies, so `*` is safe to honour.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from courier.http.access_log import note_route

logger = logging.getLogger(__name__)

ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
# Always allowed: what the OpenAI clients send. The `*` wildcard would not cover `Authorization` (Fetch standard).
ALWAYS_ALLOWED_HEADERS = ("Authorization", "Content-Type")
# Response headers a page may read beyond the safelisted ones: the SDKs' back-off reads Retry-After, and their errors
# report the request's id (OpenAI's from x-request-id, Anthropic's from request-id).
EXPOSED_HEADERS = "Retry-After, x-request-id, request-id"
PREFLIGHT_ROUTE = "preflight"  # how a preflight answered here is counted (no route of the app's matched it)
MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
MAX_REQUESTED_HEADERS = 64  # the most headers a preflight may ask for that are echoed back
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s,]+$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")

Header = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    origins: frozenset[str]  # serialized origins (`https://ui.example:8443`), lower case
    any_origin: bool = False

    @classmethod
    def from_setting(cls, text: str | None) -> CorsPolicy | None:
        """`https://a.example, http://localhost:3000` or `*`; None when nothing usable is listed (no CORS).
        An entry that is not an origin (a path, no scheme) could never match a browser's `Origin`: logged, dropped."""
        origins: set[str] = set()
        any_origin = False
        for entry in (part.strip() for part in (text or "").split(",")):
            origin = entry.rstrip("/").lower()
            if origin == ANY_ORIGIN:
                any_origin = True
            elif _ORIGIN.match(origin):
                origins.add(origin)
            elif entry:
                logger.warning("ignoring %r in --cors-allow-origins: an origin is scheme://host[:port]", entry)
        if not origins and not any_origin:
            return None
        return cls(origins=frozenset(origins), any_origin=any_origin)

    def allowed(self, origin: str | None) -> str | None:
        """The `Access-Control-Allow-Origin` value for a request from `origin`, or None: no CORS headers."""
        if origin is None:
            return None
        if self.any_origin:
            return ANY_ORIGIN
        return origin if origin.lower() in self.origins else None

    def response_headers(self, origin: str | None) -> list[Header]:
        """The headers an ordinary answer to `origin` gains (none for an origin not allowed)."""
        allowed = self.allowed(origin)
        if allowed is None:
            return []
        return [
            (b"access-control-allow-origin", allowed.encode("latin-1")),
            (b"access-control-expose-headers", EXPOSED_HEADERS.encode("latin-1")),
        ]

    def preflight_headers(self, origin: str | None, requested_headers: str | None) -> list[Header] | None:
        """The whole header list of a 204 preflight answer, or None when `origin` is not allowed (no answer here).
        The headers the browser asks for are allowed too (the SDKs send their own `x-stainless-*` ones)."""
        allowed = self.allowed(origin)
        if allowed is None:
            return None
        return [
            (b"access-control-allow-origin", allowed.encode("latin-1")),
            (b"access-control-allow-methods", ALLOWED_METHODS.encode("latin-1")),
            (b"access-control-allow-headers", ", ".join(_allowed_headers(requested_headers)).encode("latin-1")),
            (b"access-control-max-age", str(MAX_AGE_S).encode("latin-1")),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
            (b"content-length", b"0"),
        ]

    def varies(self) -> bool:
        """Whether an answer depends on the `Origin` (a listed origin is echoed): caches must then key on it."""
        return not self.any_origin


def _allowed_headers(requested: str | None) -> list[str]:
    names = list(ALWAYS_ALLOWED_HEADERS)
    seen = {name.lower() for name in names}
    for name in (part.strip() for part in (requested or "").split(",")[:MAX_REQUESTED_HEADERS]):
        if _HEADER_NAME.match(name) and name.lower() not in seen:
            seen.add(name.lower())
            names.append(name)
    return names


def with_vary_origin(headers: Iterable[Header]) -> list[Header]:
    """`headers` with `Origin` added to their `Vary` (merged into one there already, else a new one)."""
    merged: list[Header] = []
    found = False
    for name, value in headers:
        if name.lower() == b"vary" and not found:
            found = True
            listed = {part.strip().lower() for part in value.split(b",")}
            if b"origin" not in listed and b"*" not in listed:
                merged.append((name, value + b", Origin" if value.strip() else b"Origin"))
                continue
        merged.append((name, value))
    if not found:
        merged.append((b"vary", b"Origin"))
    return merged


class CorsMiddleware:
    """ASGI: answers allowed preflights, and adds the policy's headers to every other answer's start."""

    def __init__(self, app: Any, policy: CorsPolicy) -> None:
        self._app = app
        self._policy = policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request_headers = _headers(scope)
        origin = request_headers.get("origin")
        if scope.get("method") == "OPTIONS" and "access-control-request-method" in request_headers:
            preflight = self._policy.preflight_headers(origin, request_headers.get("access-control-request-headers"))
            if preflight is not None:
                note_route(PREFLIGHT_ROUTE)
                await send({"type": "http.response.start", "status": 204, "headers": preflight})
                await send({"type": "http.response.body", "body": b""})
                return
        added = self._policy.response_headers(origin)
        if not added:
            await self._app(scope, receive, send)
            return
        varies = self._policy.varies()

        async def send_with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), *added]
                message = {**message, "headers": with_vary_origin(headers) if varies else headers}
            await send(message)

        await self._app(scope, receive, send_with_cors)


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    """The request's headers by lower-case name (the first of repeated ones)."""
    found: dict[str, str] = {}
    for name, value in scope.get("headers", ()):
        found.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return found
