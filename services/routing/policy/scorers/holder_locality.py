"""`holder-locality`: prefill nodes near the holder (same value of a topology label).

A pull crosses the network from the holder to P; within one zone or rack it
is faster and cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class HolderLocalityScorer:
    name: ClassVar[str] = "holder-locality"
    # Node label that names the locality domain.
    label: str = "zone"

    def score(self, state: NodeState, ctx: LegContext) -> float:
        holder = ctx.holder
        if holder is None:
            return 0.0
        if state.node.node_id == holder.node_id:
            return 1.0
        mine = state.node.labels.get(self.label)
        return 1.0 if mine is not None and mine == holder.labels.get(self.label) else 0.0
