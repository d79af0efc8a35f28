"""The eviction coordinator's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_DELIVERY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class EvictionMetrics:
    leader: Gauge
    connected_nodes: Gauge
    releases: Counter
    moves: Counter
    release_conflicts: Counter
    commands_sent: Counter
    commands_acked: Counter
    delivery_seconds: Histogram
    purged_handles: Counter
    node_retained_bytes: Gauge
    evaluation_seconds: Histogram
    demand_reports: Counter
    demand_answer_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> EvictionMetrics:
        return cls(
            leader=Gauge(
                "kvplane_eviction_leader",
                "1 while this replica leads the eviction coordinator",
                registry=registry,
            ),
            connected_nodes=Gauge(
                "kvplane_eviction_connected_nodes",
                "Node command streams open on this replica",
                registry=registry,
            ),
            releases=Counter(
                "kvplane_eviction_releases_total",
                "Handles the coordinator released, by reason and deciding policy",
                ["reason", "policy"],
                registry=registry,
            ),
            moves=Counter(
                "kvplane_eviction_moves_total",
                "Moves to a node's host tier the coordinator sent in place of a release, by reason"
                " and deciding policy (those the node refused: commands_acked, kind move, error)",
                ["reason", "policy"],
                registry=registry,
            ),
            release_conflicts=Counter(
                "kvplane_eviction_release_conflicts_total",
                "Releases that lost to a check-out or a newer handle (the handle was not retained)",
                ["reason"],
                registry=registry,
            ),
            commands_sent=Counter(
                "kvplane_eviction_commands_sent_total",
                "Commands sent to nodes, by kind",
                ["kind"],
                registry=registry,
            ),
            commands_acked=Counter(
                "kvplane_eviction_commands_acked_total",
                "Command acknowledgements, by kind and outcome (ok, error)",
                ["kind", "outcome"],
                registry=registry,
            ),
            delivery_seconds=Histogram(
                "kvplane_eviction_release_delivery_seconds",
                "From the release decision to the node's acknowledgement",
                registry=registry,
                buckets=_DELIVERY_BUCKETS,
            ),
            purged_handles=Counter(
                "kvplane_eviction_purged_handles_total",
                "Handles of dead or restarted nodes removed through the per-node index",
                registry=registry,
            ),
            node_retained_bytes=Gauge(
                "kvplane_eviction_node_retained_bytes",
                "Bytes of KV retained in published handles, per node, as the leader last judged",
                ["node"],
                registry=registry,
            ),
            evaluation_seconds=Histogram(
                "kvplane_eviction_evaluation_seconds",
                "CPU time of one policy round (snapshot and judging, not the releases)",
                registry=registry,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            ),
            demand_reports=Counter(
                "kvplane_eviction_demand_reports_total",
                "KV demand reports received from nodes (zero demand included)",
                registry=registry,
            ),
            demand_answer_seconds=Histogram(
                "kvplane_eviction_demand_answer_seconds",
                "From receiving a node's KV demand to its releases being committed in etcd, or its "
                "moves to the node's host tier sent",
                registry=registry,
                buckets=_DELIVERY_BUCKETS,
            ),
        )
