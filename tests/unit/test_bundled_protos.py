"""xds-protos (Envoy's ext_proc stubs, for `kvplane epp`) bundles years-old copies of
opentelemetry-proto's and googleapis-common-protos' modules, which pip writes over theirs in
whichever order it installs them (deploy/scripts/setup.sh puts theirs back). The OTLP exporter
needs the current ones."""

from __future__ import annotations

from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def test_opentelemetry_protos_are_opentelemetry_protos() -> None:
    assert "scope_spans" in trace_pb2.ResourceSpans.DESCRIPTOR.fields_by_name
    assert "flags" in trace_pb2.Span.DESCRIPTOR.fields_by_name
    assert "partial_success" in trace_service_pb2.ExportTraceServiceResponse.DESCRIPTOR.fields_by_name


def test_the_google_rpc_status_is_whole() -> None:
    assert {"code", "message", "details"} <= set(status_pb2.Status.DESCRIPTOR.fields_by_name)
