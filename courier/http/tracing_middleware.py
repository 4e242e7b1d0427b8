"""ASGI middleware: one server span per HTTP request, parent of every actor span it causes.

The span starts as `<METHOD>` and the app renames it to `<METHOD> <route>` once
Quart has matched the route (unknown paths keep the short name, so span names
stay few).
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from courier.http.asgi import App, Message, Receive, Scope, Send
from courier.runtime import trace_attributes
from courier.runtime.tracing import tracer


class TracingMiddleware:
    def __init__(self, app: App) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope.get("headers", [])}
        method = scope.get("method", "GET")
        with tracer().start_as_current_span(
            method,
            context=propagate.extract(headers),
            kind=SpanKind.SERVER,
            attributes={trace_attributes.HTTP_METHOD: method, trace_attributes.URL_PATH: scope.get("path", "")},
        ) as span:

            async def send_with_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute(trace_attributes.HTTP_STATUS, status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self._app(scope, receive, send_with_status)


def name_request_span(method: str, route: str) -> None:
    span = trace.get_current_span()
    span.update_name(f"{method} {route}")
    span.set_attribute(trace_attributes.HTTP_ROUTE, route)
