"""node_budget: keep each node's retained bytes under a budget, with hysteresis.

The budget is in bytes, or a fraction of the node's KV capacity. When a
node's retained bytes exceed the high watermark, its lowest-value handles
are released until it is at or under the low watermark; between the two
nothing happens, so a node near its budget is not trimmed one handle per
evaluation.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class NodeBudget:
    """Watermarks in bytes (`high_bytes`, `low_bytes`) or as fractions of capacity.

    When both are given the tighter one applies. A node with no reported
    capacity is only held to the byte watermarks.
    """

    high_bytes: int | None = None
    low_bytes: int | None = None
    high_fraction: float | None = None
    low_fraction: float | None = None
    name: str = "node_budget"

    def __post_init__(self) -> None:
        if (self.high_bytes is None) != (self.low_bytes is None):
            raise PolicyConfigError("node_budget: give both high_bytes and low_bytes, or neither")
        if (self.high_fraction is None) != (self.low_fraction is None):
            raise PolicyConfigError("node_budget: give both high_fraction and low_fraction, or neither")
        if self.high_bytes is None and self.high_fraction is None:
            raise PolicyConfigError("node_budget: give byte or fraction watermarks")
        if (
            self.high_bytes is not None
            and self.low_bytes is not None
            and not 0 <= self.low_bytes <= self.high_bytes
        ):
            raise PolicyConfigError("node_budget: need 0 <= low_bytes <= high_bytes")
        if (
            self.high_fraction is not None
            and self.low_fraction is not None
            and not 0 <= self.low_fraction <= self.high_fraction <= 1
        ):
            raise PolicyConfigError("node_budget: need 0 <= low_fraction <= high_fraction <= 1")

    def watermarks(self, node: NodeInfo | None) -> tuple[float, float] | None:
        """(high, low) in bytes for `node`, or None when nothing applies."""
        marks: list[tuple[float, float]] = []
        if self.high_bytes is not None and self.low_bytes is not None:
            marks.append((self.high_bytes, self.low_bytes))
        capacity = node.kv_capacity_bytes if node is not None else 0
        if self.high_fraction is not None and self.low_fraction is not None and capacity > 0:
            marks.append((self.high_fraction * capacity, self.low_fraction * capacity))
        if not marks:
            return None
        return min(m[0] for m in marks), min(m[1] for m in marks)

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        by_node: dict[str, list[HandleInfo]] = defaultdict(list)
        for h in snapshot.handles:
            if h.on_device:  # the budget is of the engine's KV cache, not its host memory
                by_node[h.node_id].append(h)
        out: list[Release] = []
        for node_id in sorted(by_node):
            handles = by_node[node_id]
            marks = self.watermarks(snapshot.nodes.get(node_id))
            if marks is None:
                continue
            high, low = marks
            node = snapshot.nodes.get(node_id)
            reported = node.reported_retained_bytes if node is not None else 0
            # The node's own count wins when larger: pinned bytes the control
            # plane has no handle for can only be freed by releasing others.
            retained = max(sum(h.retained_bytes for h in handles), reported)
            if retained <= high:
                continue
            detail = f"node {node_id} retained {retained} B > high {high:.0f} B; down to low {low:.0f} B"
            for h in values.lowest_value_first(handles, snapshot):
                if retained <= low:
                    break
                out.append(Release.of(h, ReleaseReason.NODE_BUDGET, self.name, detail))
                retained -= h.retained_bytes
        return out
