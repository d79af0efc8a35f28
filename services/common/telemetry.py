"""Tracing, metrics and structured logs for one kvplane process.

Nothing here runs at import. `Telemetry.create` builds a tracer provider with
OTLP export (when an endpoint is configured) and a Prometheus registry; the
process passes the object to whatever needs it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass
class StoreMetrics:
    etcd_latency: Histogram
    etcd_errors: Counter
    handle_transitions: Counter


class Telemetry:
    """A process's tracer and metrics registry."""

    def __init__(self, tracer_provider: TracerProvider, registry: CollectorRegistry, service: str) -> None:
        self.tracer_provider = tracer_provider
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

    @classmethod
    def create(
        cls,
        service: str,
        *,
        otlp_endpoint: str = "",
        sample_ratio: float = 1.0,
        exporter: SpanExporter | None = None,
        registry: CollectorRegistry | None = None,
    ) -> Telemetry:
        """Tracing to `otlp_endpoint` (OTLP/gRPC) and/or `exporter`; sampled at `sample_ratio`."""
        provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True))
            )
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
        return cls(provider, registry or CollectorRegistry(), service)

    @classmethod
    def disabled(cls, service: str = "kvplane") -> Telemetry:
        """No sampling, private registry: for tools and tests that don't look."""
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
        return cls(provider, CollectorRegistry(), service)

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

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()


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
