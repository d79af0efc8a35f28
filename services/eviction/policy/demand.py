"""demand: give a node that is short of KV memory its retained blocks back, in value order.

An engine whose requests wait for KV memory (or whose free blocks fell under
its watermark) reports how many blocks it wants. The coordinator turns that
into `NodeInfo.demand_bytes`, net of the releases it has already sent the
node and the node has not yet acknowledged, so one shortage is answered once.

Order of checks, per node:

1. no demand, or no retained handle on the node: nothing;
2. the node's handles, least expected reuse per byte first
   (`ValueModel.least_reuse_per_byte_first`: the probability the
   conversation continues at the handle's age, within its remaining life,
   times the prefill a pull would save, per byte held); ties: oldest first;
3. released in that order until the freed bytes cover the demand, and no
   further: retention is kept as long as nobody needs the memory.

Releases carry the reason `node_budget` (the node's memory) and the policy
label `demand`. Pure: no I/O, no clock (time is the snapshot's).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.model import Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class OnDemand:
    name: str = "demand"

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        out: list[Release] = []
        for node_id in sorted(snapshot.nodes):
            out += self.for_node(snapshot, node_id, values)
        return out

    def for_node(self, snapshot: Snapshot, node_id: str, values: ValueModel) -> list[Release]:
        """Releases that cover `node_id`'s demand, cheapest first; empty without demand."""
        node = snapshot.nodes.get(node_id)
        if node is None or node.demand_bytes <= 0:
            return []
        # Host-tier handles hold none of the engine's KV cache: releasing them frees none.
        handles = [h for h in snapshot.handles if h.node_id == node_id and h.on_device]
        detail = f"node {node_id} needs {node.demand_bytes} B of KV for waiting requests"
        out: list[Release] = []
        freed = 0
        for h in values.least_reuse_per_byte_first(handles, snapshot):
            if freed >= node.demand_bytes:
                break
            out.append(Release.of(h, ReleaseReason.NODE_BUDGET, self.name, detail))
            freed += h.retained_bytes
        return out
