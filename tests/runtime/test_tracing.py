from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.runtime.message import Message
from courier.runtime.tracing import JsonLinesSpanExporter, _exporters, current_carrier, message_span, tracer


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping(Message):
    pass


def test_message_span_is_named_after_actor_and_message_and_joins_the_senders_trace(
    span_exporter: InMemorySpanExporter,
) -> None:
    with tracer().start_as_current_span("http") as parent:
        carrier = current_carrier()
    with message_span("scheduler", Ping(), carrier):
        pass
    spans = {span.name: span for span in span_exporter.get_finished_spans()}
    handled = spans["scheduler.Ping"]
    assert handled.context.trace_id == parent.get_span_context().trace_id
    assert handled.parent is not None and handled.parent.span_id == parent.get_span_context().span_id
    assert handled.attributes is not None and handled.attributes["courier.actor"] == "scheduler"


def test_json_lines_exporter_writes_one_span_per_line(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "spans.jsonl"
    provider = TracerProvider()
    exporter = JsonLinesSpanExporter(path)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    local = provider.get_tracer("test")
    with local.start_as_current_span("outer"), local.start_as_current_span("inner"):
        pass
    provider.shutdown()
    records = [orjson.loads(line) for line in path.read_text().splitlines()]
    assert [record["name"] for record in records] == ["inner", "outer"]
    assert records[0]["context"]["trace_id"] == records[1]["context"]["trace_id"]
    assert records[0]["parent_id"] == records[1]["context"]["span_id"]


def test_exporter_selection_follows_otel_variables(tmp_path: Path) -> None:
    assert _exporters({}, None) == []
    assert [type(e) for e in _exporters({"OTEL_TRACES_EXPORTER": "console"}, None)] == [ConsoleSpanExporter]
    assert [type(e).__name__ for e in _exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, None)] == [
        "OTLPSpanExporter"
    ]
    assert _exporters({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, None) == []
    with_file = _exporters({}, tmp_path / "t.jsonl")
    assert [type(e) for e in with_file] == [JsonLinesSpanExporter]
    for exporter in with_file:
        exporter.shutdown()
