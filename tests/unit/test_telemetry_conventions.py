"""OpenTelemetry's standard variables configure every kvplane process; heartbeats start no traces."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from kvplane.services.cli import service_name
from kvplane.services.common.runtime.telemetry import OtlpTarget, Telemetry, otlp_export

_OTEL_VARIABLES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SDK_DISABLED",
)


@pytest.fixture(autouse=True)
def _clean_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _spans(telemetry: Telemetry, exporter: InMemorySpanExporter) -> list[str]:
    telemetry.tracer_provider.force_flush()
    return [span.name for span in exporter.get_finished_spans()]


def test_each_process_names_itself_as_its_service() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-routing", exporter=exporter)
    with telemetry.tracer.start_as_current_span("work"):
        pass
    telemetry.tracer_provider.force_flush()
    resource = exporter.get_finished_spans()[0].resource.attributes
    assert resource["service.name"] == "kvplane-routing"
    assert resource["service.namespace"] == "kvplane"
    telemetry.shutdown()


def test_serving_one_service_names_it_and_serving_all_names_the_bundle() -> None:
    assert service_name(["metadata"]) == "kvplane-metadata"
    assert service_name(["eviction"]) == "kvplane-eviction"
    assert service_name(["metadata", "routing", "eviction"]) == "kvplane-control-plane"


def test_otel_service_name_and_resource_attributes_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-eu-1")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,service.namespace=llm")
    telemetry = Telemetry.create("kvplane-routing")
    resource = telemetry.tracer_provider.resource.attributes
    assert resource["service.name"] == "router-eu-1"
    assert resource["service.namespace"] == "llm"
    assert resource["deployment.environment"] == "staging"


def test_service_name_in_resource_attributes_alone_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=edge-gateway")
    telemetry = Telemetry.create("kvplane-gateway")
    assert telemetry.tracer_provider.resource.attributes["service.name"] == "edge-gateway"


def test_heartbeats_load_reports_and_background_etcd_start_no_trace_by_default() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", exporter=exporter)
    tracer = telemetry.tracer
    for method in ("KeepAlive", "ReportLoad"):
        with tracer.start_as_current_span(
            f"/kvplane.v1.MetadataService/{method}", kind=trace.SpanKind.SERVER
        ):
            pass
    with telemetry.etcd_span("lease_refresh"):
        pass
    with tracer.start_as_current_span("/grpc.health.v1.Health/Check", kind=trace.SpanKind.SERVER):
        pass
    assert _spans(telemetry, exporter) == []
    telemetry.shutdown()


def test_requests_still_start_traces_and_etcd_calls_inside_them_are_kept() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", exporter=exporter)
    with (
        telemetry.tracer.start_as_current_span(
            "/kvplane.v1.MetadataService/PublishHandles", kind=trace.SpanKind.SERVER
        ),
        telemetry.etcd_span("publish_handle"),
    ):
        pass
    assert _spans(telemetry, exporter) == [
        "etcd.publish_handle",
        "/kvplane.v1.MetadataService/PublishHandles",
    ]
    telemetry.shutdown()


def test_a_heartbeat_inside_a_sampled_trace_follows_its_parent() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", exporter=exporter)
    with (
        telemetry.tracer.start_as_current_span("operator.debug"),
        telemetry.tracer.start_as_current_span(
            "/kvplane.v1.MetadataService/ReportLoad", kind=trace.SpanKind.SERVER
        ),
    ):
        pass
    assert _spans(telemetry, exporter) == ["/kvplane.v1.MetadataService/ReportLoad", "operator.debug"]
    telemetry.shutdown()


def test_trace_background_setting_traces_heartbeats_too() -> None:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", exporter=exporter, trace_background=True)
    with telemetry.tracer.start_as_current_span(
        "/kvplane.v1.MetadataService/KeepAlive", kind=trace.SpanKind.SERVER
    ):
        pass
    assert _spans(telemetry, exporter) == ["/kvplane.v1.MetadataService/KeepAlive"]
    telemetry.shutdown()


def test_otel_traces_sampler_replaces_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", sample_ratio=0.0, exporter=exporter)
    with telemetry.tracer.start_as_current_span(
        "/kvplane.v1.MetadataService/KeepAlive", kind=trace.SpanKind.SERVER
    ):
        pass
    assert _spans(telemetry, exporter) == ["/kvplane.v1.MetadataService/KeepAlive"]
    telemetry.shutdown()

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-metadata", exporter=exporter)
    with telemetry.tracer.start_as_current_span("turn"):
        pass
    assert _spans(telemetry, exporter) == []
    telemetry.shutdown()


def test_the_otlp_endpoint_variable_alone_turns_export_on() -> None:
    assert otlp_export("", {}) is None
    # The exporter reads the endpoint, headers and certificate from the environment itself.
    assert otlp_export("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"}) == OtlpTarget()
    assert otlp_export("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}) == OtlpTarget()
    switched_off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}
    assert otlp_export("", switched_off) is None
    assert otlp_export("c:4317", {"OTEL_SDK_DISABLED": "true"}) is None


def test_kvplanes_own_endpoint_setting_still_means_plaintext_unless_a_certificate_is_set() -> None:
    assert otlp_export("collector:4317", {}) == OtlpTarget("collector:4317", insecure=True)
    with_ca = {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem"}
    assert otlp_export("collector:4317", with_ca) == OtlpTarget("collector:4317", insecure=False)
    assert otlp_export("https://collector:4317", {}) == OtlpTarget("https://collector:4317", insecure=None)


def test_every_process_registry_has_process_metrics() -> None:
    text = generate_latest(Telemetry.create("kvplane-routing").registry).decode()
    assert "process_cpu_seconds_total" in text
    assert "process_resident_memory_bytes" in text
    assert "python_info" in text


def test_a_process_that_exports_nothing_records_no_new_trace_but_follows_a_sampled_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    telemetry = Telemetry.create("kvplane-routing")
    assert not telemetry.exports
    with telemetry.tracer.start_as_current_span("/kvplane.v1.RoutingService/Route") as span:
        assert not span.is_recording()
        # The context still carries a trace id, for the logs and for whatever it calls.
        assert span.get_span_context().trace_id != 0
    caller = trace.SpanContext(
        trace_id=7, span_id=9, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
    )
    parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
    with telemetry.tracer.start_as_current_span("/kvplane.v1.RoutingService/Route", context=parent) as span:
        assert span.is_recording() and span.get_span_context().trace_id == 7
    assert Telemetry.create("kvplane-routing", exporter=InMemorySpanExporter()).exports
