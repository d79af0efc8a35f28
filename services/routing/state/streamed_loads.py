"""The loads nodes stream to this routing replica (StreamPrefixCache), used in place of etcd's.

Why loads travel this way: a node's load (requests queued and running, prefill tokens waiting,
free KV blocks) changes with every request it takes, routing is its only reader at that
grain, and it is a hint routing corrects with its own ledger of what it routed
(`state.inflight`). Written to etcd it cost a consensus write per engine every half second
while the engine was busy, the same order as the turns themselves. Streamed, it costs one
small message to each routing replica, never a disk write. etcd still gets the node's load at
the heartbeat and when its memory changed materially (`connector.node_agent.load`), for the
eviction coordinator and for any replica the node does not stream to.

A streamed load is used while its stream is fresh (a message within `stale_after_s`: the
agent sends a keep-alive at least every 2 s), for the same incarnation as the
registration routing sees, and when it is no older than the load etcd holds. Otherwise the
stored load stands, so a node whose stream broke is judged as before.

Pure bookkeeping: no I/O; time is an argument.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvplane.services.common.model.nodes import Node, NodeLoad


@dataclass(slots=True)
class _Stream:
    incarnation: str
    load: NodeLoad | None
    heard_s: float


class StreamedLoads:
    """The newest streamed load of each node, and when its stream was last heard."""

    def __init__(self, stale_after_s: float, max_nodes: int) -> None:
        if stale_after_s <= 0 or max_nodes < 1:
            raise ValueError("stale_after_s must be positive and max_nodes at least 1")
        self.stale_after_s = stale_after_s
        self.max_nodes = max_nodes
        # node id -> its stream, least recently heard first.
        self._streams: OrderedDict[str, _Stream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def heard(self, node_id: str, incarnation: str, load: NodeLoad | None, now_s: float) -> None:
        """A message of `node_id`'s stream arrived, with its load when it carried one."""
        stream = self._streams.pop(node_id, None)
        if stream is None or stream.incarnation != incarnation:
            stream = _Stream(incarnation, None, now_s)
        stream.heard_s = now_s
        if load is not None:
            stream.load = load
        self._streams[node_id] = stream
        while len(self._streams) > self.max_nodes:
            self._streams.popitem(last=False)

    def load(self, node: Node, stored: NodeLoad | None, now_s: float) -> NodeLoad | None:
        """The node's load for routing: the streamed one while its stream is fresh and it is at
        least as new as `stored` (etcd's), else `stored`."""
        stream = self._streams.get(node.node_id)
        if (
            stream is None
            or stream.load is None
            or stream.incarnation != node.incarnation
            or now_s - stream.heard_s > self.stale_after_s
        ):
            return stored
        if stored is not None and stored.reported_unix_ms > stream.load.reported_unix_ms:
            return stored
        return stream.load

    def newest_report_unix_ms(self, now_s: float) -> int:
        """The newest report time among fresh streamed loads (0: none)."""
        return max(
            (
                s.load.reported_unix_ms
                for s in self._streams.values()
                if s.load is not None and now_s - s.heard_s <= self.stale_after_s
            ),
            default=0,
        )
