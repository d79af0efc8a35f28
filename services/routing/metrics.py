"""The routing service's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LIFE_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960)
_ROUTE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


@dataclass
class RoutingMetrics:
    routes: Counter
    tokens: Counter
    life_left_at_checkout: Histogram
    route_seconds: Histogram
    publish_waits: Histogram
    publish_waiting: Gauge
    reports: Counter
    decode_retention: Counter
    prefill_moves: Counter
    recompute_seconds_per_token: Gauge
    prefill_fixed_seconds: Gauge
    reused_seconds_per_token: Gauge
    transfer_bytes_per_second: Gauge
    transfer_overhead_seconds: Gauge
    node_streams: Gauge
    node_stream_messages: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RoutingMetrics:
        return cls(
            routes=Counter(
                "kvplane_routes_total",
                "Routed turns by decision (pull, recompute, decode: prefilled on D) and reason code",
                ["decision", "reason"],
                registry=registry,
            ),
            decode_retention=Counter(
                "kvplane_route_decode_retention_total",
                "Routed turns whose decode engine was told to keep its KV for the next turn (kept) "
                "or that a pull of it would not pay (skipped)",
                ["outcome"],
                registry=registry,
            ),
            prefill_moves=Counter(
                "kvplane_route_prefill_moves_total",
                "Routed turns sent off the prefill node believed to hold the most of their prompt "
                "(the Route span's kvplane.moved_from says why)",
                registry=registry,
            ),
            tokens=Counter(
                "kvplane_route_tokens_total",
                "Prompt tokens of routed turns that routing expected to be pulled (reused) or recomputed, "
                "at Route time; what the engines did is kvplane_gateway_prompt_tokens_total",
                ["kind"],
                registry=registry,
            ),
            life_left_at_checkout=Histogram(
                "kvplane_handle_life_left_at_checkout_seconds",
                "Wall-clock life a handle had left when it was checked out",
                registry=registry,
                buckets=_LIFE_BUCKETS,
            ),
            route_seconds=Histogram(
                "kvplane_route_seconds",
                "Time to answer Route, including the check-out transaction",
                registry=registry,
                buckets=_ROUTE_BUCKETS,
            ),
            publish_waits=Histogram(
                "kvplane_route_publish_wait_seconds",
                "Time a Route waited for the engine's publish of the handle its caller awaited, by "
                "outcome (published; ended: it was published and is gone already; timeout); a Route whose "
                "prefill node holds the history does not wait",
                ["outcome"],
                registry=registry,
                buckets=_ROUTE_BUCKETS,
            ),
            publish_waiting=Gauge(
                "kvplane_route_publish_waiting",
                "Routes and EndConversations waiting now for the engine's publish of an awaited handle",
                registry=registry,
            ),
            reports=Counter(
                "kvplane_turn_reports_total",
                "ReportTurn calls by outcome (success, failure) and whether a handle was published",
                ["outcome", "published"],
                registry=registry,
            ),
            recompute_seconds_per_token=Gauge(
                "kvplane_cost_recompute_seconds_per_token",
                "Current estimate of prefill time per computed prompt token, in seconds",
                registry=registry,
            ),
            prefill_fixed_seconds=Gauge(
                "kvplane_cost_prefill_fixed_seconds",
                "Current estimate of a prefill's fixed time per request, in seconds",
                registry=registry,
            ),
            reused_seconds_per_token=Gauge(
                "kvplane_cost_reused_seconds_per_token",
                "Current estimate of prefill time per prompt token reused (cached or pulled), in seconds",
                registry=registry,
            ),
            transfer_bytes_per_second=Gauge(
                "kvplane_cost_transfer_bytes_per_second",
                "Current estimate of KV pull bandwidth, in bytes per second",
                registry=registry,
            ),
            transfer_overhead_seconds=Gauge(
                "kvplane_cost_transfer_overhead_seconds",
                "Current estimate of a warm KV pull's fixed time, in seconds",
                registry=registry,
            ),
            node_streams=Gauge(
                "kvplane_routing_node_streams",
                "Nodes' StreamPrefixCache calls open on this replica (each node agent keeps one to every "
                "routing replica it is given)",
                registry=registry,
            ),
            node_stream_messages=Counter(
                "kvplane_routing_node_stream_messages_total",
                "Messages received on nodes' streams: with prefix-cache events (cache) or the engine's "
                "load alone (load)",
                ["kind"],
                registry=registry,
            ),
        )


class EngineCacheBlocks(Collector):
    """`kvplane_routing_engine_cache_blocks{node}`, read from the replica's engine views at scrape
    time: what routing knows of each engine's prefix cache."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvplane_routing_engine_cache_blocks",
            "Blocks each engine's prefix cache holds as its KV-cache events, streamed by its node "
            "agent, show it to this replica",
            labels=["node"],
        )
        for node_id, blocks in sorted(self._counts().items()):
            family.add_metric([node_id], blocks)
        yield family
