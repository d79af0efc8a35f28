"""The connector's spans join the request's trace, and a request without trace headers gets none."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.connector.request_spans import current_trace_context, request_span

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _tracer() -> tuple[InMemorySpanExporter, trace.Tracer]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider.get_tracer("test")


def test_a_span_joins_the_trace_named_by_the_request_headers() -> None:
    exporter, tracer = _tracer()
    with request_span(tracer, "kvplane.publish", {"traceparent": PARENT}, node="d0") as span:
        assert span is not None
        carried = current_trace_context()
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "kvplane.publish" and dict(finished.attributes or {}) == {"node": "d0"}
    assert format(finished.context.trace_id, "032x") == TRACE_ID
    assert finished.parent is not None and format(finished.parent.span_id, "016x") == "00f067aa0ba902b7"
    # What the node agent's publish carries on: this span, in the same trace.
    assert carried["traceparent"].split("-")[1:3] == [TRACE_ID, format(finished.context.span_id, "016x")]


def test_a_request_without_trace_headers_gets_no_span() -> None:
    exporter, tracer = _tracer()
    for headers in (None, {}):
        with request_span(tracer, "kvplane.pull_check", headers) as span:
            assert span is None
    assert exporter.get_finished_spans() == ()
