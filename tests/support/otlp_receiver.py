"""A small OTLP/gRPC trace receiver on a free loopback port: what a collector would be sent.

Processes export to it exactly as to a real collector (`OTEL_EXPORTER_OTLP_ENDPOINT`); a test
reads back every span with its process's resource.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from kvplane.services.common.runtime.ports import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    # Empty for a trace's root.
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    # (trace id, span id) of each linked span.
    links: tuple[tuple[str, str], ...]
    resource: dict[str, Any]
    # Nanoseconds since the epoch.
    start_time: int = 0
    end_time: int = 0


def _value(v: AnyValue) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[ReceivedSpan], lock: threading.Lock) -> None:
        self.sink = sink
        self.lock = lock

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            resource=resource,
                            start_time=span.start_time_unix_nano,
                            end_time=span.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.sink.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start, point processes at `endpoint`, read `spans()`, stop."""

    def __init__(self) -> None:
        self.port = free_port()
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _Servicer(self._spans, self._lock), self._server
        )

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT: a plaintext gRPC URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


@contextmanager
def receiver_as_collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A started receiver that this process and the processes it starts export to, configured
    only as an operator would: `OTEL_EXPORTER_OTLP_ENDPOINT`, with no other OTEL_* override in
    the way. A short batch delay only makes spans arrive sooner."""
    server = OtlpReceiver()
    server.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", server.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    for name in ("OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield server
    finally:
        server.stop()
