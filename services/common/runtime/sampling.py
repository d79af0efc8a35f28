"""Which new traces a kvplane process starts, when the operator has not chosen a sampler.

Engines report load twice a second and renew leases; health checks poll; the control plane's own
loops read and write etcd. Each of those, seen by a server interceptor or an etcd span without a
parent, would start a trace of its own and bury the turns (thousands of traces against a handful of
turns). By default kvplane starts traces only for work someone asked for: a turn, a Route, a
publish, an eviction. Spans inside an existing trace are never affected: `ParentBased` follows the
caller's decision, so a heartbeat sent from inside a traced request would still be recorded.

`OTEL_TRACES_SAMPLER` replaces all of this with the SDK's sampler (`telemetry.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

# Server spans (named by the gRPC method) of periodic, machine-driven calls.
BACKGROUND_METHODS = frozenset(
    {
        "/kvplane.v1.MetadataService/KeepAlive",
        "/kvplane.v1.MetadataService/ReportLoad",
        "/kvplane.v1.MetadataService/Watch",
        "/kvplane.v1.EvictionService/Commands",
        "/kvplane.v1.EvictionService/GetStatus",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    }
)


def is_background_root(name: str, kind: SpanKind | None, attributes: Attributes) -> bool:
    """True for a span that would start a trace for a heartbeat, a poll or a control loop's etcd call."""
    if name in BACKGROUND_METHODS:
        return True
    # An etcd request without a parent comes from a lease keep-alive, a watch or a reaper's scan,
    # never from a caller: requests made for a call are children of its server span.
    return kind == SpanKind.CLIENT and attributes is not None and attributes.get("db.system") == "etcd"


class QuietBackground(Sampler):
    """Drops background roots (see `is_background_root`); asks `root` about every other new trace."""

    def __init__(self, root: Sampler) -> None:
        self._root = root

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if is_background_root(name, kind, attributes):
            return SamplingResult(Decision.DROP, None, trace_state)
        return self._root.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"QuietBackground{{{self._root.get_description()}}}"
