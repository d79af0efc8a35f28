"""Tracing, metrics and structured logs for one kvplane process.

Nothing here runs at import. `Telemetry.create` builds a tracer provider with
OTLP export (when an endpoint is configured) and a Prometheus registry; the
process passes the object to whatever needs it.

OpenTelemetry's standard variables mean what they mean everywhere else:

- `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) alone turns on OTLP/gRPC export; the
  exporter itself reads `..._HEADERS`, `..._CERTIFICATE`, `..._CLIENT_KEY`/`..._CLIENT_CERTIFICATE`,
  `..._INSECURE`, `..._TIMEOUT` and `..._COMPRESSION`. A `telemetry.otlp_endpoint` setting, when
  given, names the endpoint instead. `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true` turn
  export off.
- `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` win over the name each process gives itself
  (`kvplane-routing`, `kvplane-gateway`, ...).
- `OTEL_TRACES_SAMPLER` (with `OTEL_TRACES_SAMPLER_ARG`) replaces kvplane's default sampler, which
  is parent-based with `telemetry.sample_ratio` for new traces and starts no trace for heartbeats,
  load reports, health checks or background etcd requests (`sampling.py`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from kvplane.services.common.runtime.sampling import QuietBackground
from kvplane.services.common.runtime.trace_ids import OwnRandomIdGenerator

log = logging.getLogger(__name__)

# The longest a stopping process waits for its last spans to be exported, seconds.
SHUTDOWN_TIMEOUT_S = 2.0

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass
class StoreMetrics:
    etcd_latency: Histogram
    etcd_errors: Counter
    handle_transitions: Counter


class Telemetry:
    """A process's tracer and metrics registry."""

    def __init__(
        self,
        tracer_provider: TracerProvider,
        registry: CollectorRegistry,
        service: str,
        *,
        exports: bool = True,
    ) -> None:
        self.tracer_provider = tracer_provider
        # Whether any span leaves the process. When none does, the process records none and
        # its gRPC calls carry no tracing interceptors (a fifth of a service's CPU per call).
        self.exports = exports
        self.registry = registry
        self.service = service
        self.tracer = tracer_provider.get_tracer("kvplane")
        self.store = StoreMetrics(
            etcd_latency=Histogram(
                "kvplane_etcd_request_seconds",
                "etcd request latency by operation and outcome",
                ["op", "outcome"],
                registry=registry,
                buckets=_LATENCY_BUCKETS,
            ),
            etcd_errors=Counter(
                "kvplane_etcd_errors_total",
                "etcd requests that failed, by operation",
                ["op"],
                registry=registry,
            ),
            handle_transitions=Counter(
                "kvplane_handle_transitions_total",
                "Handle state transitions by kind (published, checked_out, released) and reason",
                ["transition", "reason"],
                registry=registry,
            ),
        )
        self._gauges: dict[str, Gauge] = {}
        add_process_metrics(registry)

    @classmethod
    def create(
        cls,
        service: str,
        *,
        otlp_endpoint: str = "",
        sample_ratio: float = 1.0,
        trace_background: bool = False,
        exporter: SpanExporter | None = None,
        registry: CollectorRegistry | None = None,
    ) -> Telemetry:
        """Tracing to OTLP (see the module docstring) and/or `exporter`, as `service` unless renamed."""
        export = otlp_export(otlp_endpoint, os.environ)
        exports = export is not None or exporter is not None
        provider = TracerProvider(
            resource=service_resource(service),
            sampler=sampler(sample_ratio, trace_background, os.environ, exports=exports),
            id_generator=OwnRandomIdGenerator(),
        )
        if export is not None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=export.endpoint, insecure=export.insecure))
            )
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
        return cls(provider, registry or CollectorRegistry(), service, exports=exports)

    @classmethod
    def disabled(cls, service: str = "kvplane") -> Telemetry:
        """No sampling, private registry: for tools and tests that don't look."""
        provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(0.0)), id_generator=OwnRandomIdGenerator()
        )
        return cls(provider, CollectorRegistry(), service, exports=False)

    @contextmanager
    def etcd_span(self, op: str, **attributes: Any) -> Iterator[trace.Span]:
        """A child span and a latency sample for one etcd request."""
        start = time.perf_counter()
        outcome = "ok"
        with self.tracer.start_as_current_span(
            f"etcd.{op}", kind=trace.SpanKind.CLIENT, attributes={"db.system": "etcd", **attributes}
        ) as span:
            try:
                yield span
            except BaseException:
                outcome = "error"
                self.store.etcd_errors.labels(op).inc()
                raise
            finally:
                self.store.etcd_latency.labels(op, outcome).observe(time.perf_counter() - start)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flushes and stops tracing, waiting at most `timeout_s`.

        The exporter retries an unreachable collector for up to ten seconds,
        past a stopping pod's usual grace period; beyond `timeout_s` the spans
        still queued are dropped and the process goes on stopping (the export
        threads are daemons, and a second shutdown returns at once).
        """
        stopper = threading.Thread(
            target=self.tracer_provider.shutdown, name="telemetry-shutdown", daemon=True
        )
        stopper.start()
        stopper.join(timeout_s)
        if stopper.is_alive():
            log.warning(
                "trace export did not flush within %.1f s; the remaining spans are dropped", timeout_s
            )


def service_resource(service: str) -> Resource:
    """The process's resource: `service` as `service.name` unless the operator's variables name it."""
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; what Resource.create is given would override them.
    detected = OTELResourceDetector().detect().attributes
    ours = {SERVICE_NAME: service, "service.namespace": "kvplane"}
    return Resource.create({k: v for k, v in ours.items() if k not in detected})


def sampler(
    sample_ratio: float, trace_background: bool, environ: Mapping[str, str], *, exports: bool = True
) -> Sampler | None:
    """kvplane's default sampler, or None where `OTEL_TRACES_SAMPLER` chooses (the SDK reads it).

    Where no span is exported, no new trace is recorded: spans that nothing reads would cost
    every call their attributes and bookkeeping. A caller's sampled trace is still followed,
    so its context reaches the engines unbroken.
    """
    if environ.get("OTEL_TRACES_SAMPLER"):
        return None
    if not exports:
        return ParentBased(ALWAYS_OFF)
    root: Sampler = TraceIdRatioBased(sample_ratio)
    return ParentBased(root if trace_background else QuietBackground(root))


@dataclass(frozen=True)
class OtlpTarget:
    """Where to export; None fields are read by the exporter from OTEL_EXPORTER_OTLP_* itself."""

    endpoint: str | None = None
    insecure: bool | None = None


def otlp_export(otlp_endpoint: str, environ: Mapping[str, str]) -> OtlpTarget | None:
    """Where the OTLP exporter sends spans, or None when nothing asks for export."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if otlp_endpoint:
        # A bare host:port from kvplane's own setting has always meant plaintext; a URL says itself.
        insecure = None if "://" in otlp_endpoint else environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE") is None
        return OtlpTarget(otlp_endpoint, insecure)
    if environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return OtlpTarget()
    return None


def add_process_metrics(registry: CollectorRegistry) -> None:
    """`process_*` (CPU seconds, memory bytes, open fds, start time) and `python_info` in `registry`."""
    # A registry shared by several Telemetry objects (tests, `serve all`) has them already.
    with contextlib.suppress(ValueError):
        ProcessCollector(registry=registry)
    with contextlib.suppress(ValueError):
        PlatformCollector(registry=registry)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line, with any `extra=` fields merged in."""

    _RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._RESERVED and not key.startswith("_"):
                entry[key] = value
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            entry["trace_id"] = f"{span.trace_id:032x}"
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "info", json_logs: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter()
        if json_logs
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
