"""OpenTelemetry set-up and the helpers that carry trace context across actor messages.

Exporters come from the standard variables: `OTEL_TRACES_EXPORTER` (comma-separated
`otlp`, `console`, `none`; when unset, `otlp` if an OTLP endpoint variable is set,
else none), `OTEL_EXPORTER_OTLP_ENDPOINT` and friends (read by the OTLP/HTTP exporter
itself), `OTEL_SERVICE_NAME` (default `courier`). `--trace-file` adds a JSON-lines file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)

from courier.runtime import trace_attributes

logger = logging.getLogger(__name__)

TRACER_NAME = "courier"
DEFAULT_SERVICE_NAME = "courier"
_OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")

TraceCarrier = dict[str, str]


class JsonLinesSpanExporter(SpanExporter):
    """Writes each finished span as one line of OpenTelemetry's JSON span format."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure_tracing(environ: Mapping[str, str], trace_file: Path | None) -> TracerProvider:
    """Install the global tracer provider with the exporters the environment asks for."""
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in _exporters(environ, trace_file):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def _exporters(environ: Mapping[str, str], trace_file: Path | None) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    if trace_file is not None:
        exporters.append(JsonLinesSpanExporter(trace_file))
    requested = environ.get("OTEL_TRACES_EXPORTER")
    if requested is None:
        requested = "otlp" if any(environ.get(name) for name in _OTLP_ENDPOINT_VARIABLES) else "none"
    for name in (part.strip().lower() for part in requested.split(",")):
        if name in ("", "none"):
            continue
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        else:
            logger.warning("ignoring OTEL_TRACES_EXPORTER entry %r: use otlp, console or none", name)
    return exporters


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def current_carrier() -> TraceCarrier:
    """The active trace context, for a message about to be sent."""
    carrier: TraceCarrier = {}
    propagate.inject(carrier)
    return carrier


@contextmanager
def message_span(actor: str, message: object, carrier: TraceCarrier) -> Iterator[trace.Span]:
    """A span `<actor>.<Message>` parented on the context the message carried."""
    message_name = type(message).__name__
    attributes = {trace_attributes.ACTOR: actor, trace_attributes.MESSAGE: message_name}
    with carried_span(f"{actor}.{message_name}", carrier, attributes) as span:
        yield span


def record_span(name: str, carrier: TraceCarrier, started_ns: int, attributes: Mapping[str, str | int | float]) -> None:
    """A span for work already done (from `started_ns`, wall clock, until now), parented on a carried context."""
    span = tracer().start_span(name, context=propagate.extract(carrier), start_time=started_ns, attributes=attributes)
    span.end()


@contextmanager
def carried_span(name: str, carrier: TraceCarrier, attributes: Mapping[str, str] | None = None) -> Iterator[trace.Span]:
    """A span `name` parented on a context captured earlier: a message's handling, or work done later for it."""
    token = otel_context.attach(propagate.extract(carrier))
    try:
        with tracer().start_as_current_span(name, attributes=attributes) as span:
            yield span
    finally:
        otel_context.detach(token)
