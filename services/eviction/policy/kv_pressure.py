"""kv_pressure: free retained blocks when a node runs short of free KV.

A decode engine that runs out of free blocks preempts live requests; the
retained blocks of idle conversations are the cheapest memory to give back.
When a node reports less than `low_free_fraction` of its KV free, its
lowest-value handles are released until the freed bytes would bring it to
`target_free_fraction`. Needs the node's KV capacity to convert.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.model import HandleInfo, Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class KvPressure:
    low_free_fraction: float = 0.05
    target_free_fraction: float = 0.15
    name: str = "kv_pressure"

    def __post_init__(self) -> None:
        if not 0 <= self.low_free_fraction <= self.target_free_fraction <= 1:
            raise PolicyConfigError("kv_pressure: need 0 <= low_free_fraction <= target_free_fraction <= 1")

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        by_node: dict[str, list[HandleInfo]] = defaultdict(list)
        for h in snapshot.handles:
            if h.on_device:  # a host-tier handle frees none of the engine's KV cache
                by_node[h.node_id].append(h)
        out: list[Release] = []
        for node_id in sorted(by_node):
            node = snapshot.nodes.get(node_id)
            if node is None or node.kv_capacity_bytes <= 0 or node.free_kv_fraction >= self.low_free_fraction:
                continue
            needed = (self.target_free_fraction - node.free_kv_fraction) * node.kv_capacity_bytes
            detail = (
                f"node {node_id} has {node.free_kv_fraction:.1%} KV free < {self.low_free_fraction:.1%};"
                f" freeing {needed:.0f} B toward {self.target_free_fraction:.1%}"
            )
            freed = 0
            for h in values.lowest_value_first(by_node[node_id], snapshot):
                if freed >= needed:
                    break
                out.append(Release.of(h, ReleaseReason.NODE_BUDGET, self.name, detail))
                freed += h.retained_bytes
        return out
