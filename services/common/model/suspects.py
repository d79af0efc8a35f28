"""Suspect nodes: an engine that just failed a leg of a turn is avoided by
every routing replica at once, without waiting for its registration lease
to lapse, until it proves alive.

The mark lives in etcd under a short lease (`node-suspects/{node}`); the
cluster view carries it to every replica. It stands while all of these hold:
the node still runs the incarnation that failed, and no load report taken
after the mark has arrived (the node agent runs in the engine's process, so
a fresh report means the engine is up again).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.v1 import node_pb2

MAX_REASON_BYTES = 1024


@dataclass(frozen=True, slots=True)
class NodeSuspect:
    node_id: str
    incarnation: str
    marked_unix_ms: int
    reason: str = ""

    def stands(self, node: Node, load: NodeLoad | None) -> bool:
        """Whether `node` (with its latest `load`) is still under this mark."""
        if node.node_id != self.node_id or node.incarnation != self.incarnation:
            return False
        return (
            load is None
            or load.incarnation != node.incarnation
            or load.reported_unix_ms <= self.marked_unix_ms
        )

    def to_pb(self) -> node_pb2.NodeSuspect:
        reason = self.reason.encode("utf-8")[:MAX_REASON_BYTES].decode("utf-8", "ignore")
        return node_pb2.NodeSuspect(
            node_id=self.node_id,
            incarnation=self.incarnation,
            marked_unix_ms=self.marked_unix_ms,
            reason=reason,
        )

    @classmethod
    def from_pb(cls, pb: node_pb2.NodeSuspect) -> NodeSuspect:
        return cls(pb.node_id, pb.incarnation, pb.marked_unix_ms, pb.reason)
