"""The connector's spans: its work for a request, inside that request's trace.

vLLM keeps a request's `traceparent` (`Request.trace_headers`) when its own tracing is on
(`--otlp-traces-endpoint`). The connector then records, in the scheduler process, the prefix
check of a pull (`kvplane.pull_check`) and the handle it hands to the node agent
(`kvplane.publish`), whose PublishHandles call carries the same trace context: the turn's trace
runs from the gateway through both engines to the metadata service. A request without trace
headers gets no span: the scheduler loop starts no traces of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate, trace


@contextmanager
def request_span(
    tracer: trace.Tracer, name: str, trace_headers: Mapping[str, str] | None, **attributes: Any
) -> Iterator[trace.Span | None]:
    """A span in the request's trace, current while the block runs; None without trace headers."""
    if not trace_headers:
        yield None
        return
    with tracer.start_as_current_span(
        name, context=propagate.extract(dict(trace_headers)), attributes=attributes
    ) as span:
        yield span


def current_trace_context() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for the node agent's publish."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
