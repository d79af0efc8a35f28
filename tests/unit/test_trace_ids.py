"""Trace and span ids come from a generator of the process's own, not from the random module."""

from __future__ import annotations

import random

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.runtime.trace_ids import OwnRandomIdGenerator


def test_spans_leave_the_random_module_alone_and_ids_do_not_follow_its_seed() -> None:
    exported, quiet = Telemetry.create("kvplane-test", exporter=InMemorySpanExporter()), Telemetry.disabled()
    ids = []
    for telemetry in (exported, quiet, exported):
        random.seed(7)
        state = random.getstate()
        with telemetry.tracer.start_as_current_span("turn") as span:
            context = span.get_span_context()
        # Seeding the module alike (a library, a test framework) gives no two spans one id.
        assert random.getstate() == state
        ids.append((context.trace_id, context.span_id))
    assert len(set(ids)) == len(ids)
    exported.shutdown()


def test_ids_are_never_the_invalid_zero_and_do_not_repeat() -> None:
    ids = OwnRandomIdGenerator()
    spans = {ids.generate_span_id() for _ in range(1000)}
    traces = {ids.generate_trace_id() for _ in range(1000)}
    assert len(spans) == len(traces) == 1000 and 0 not in spans | traces
    assert ids.is_trace_id_random()
