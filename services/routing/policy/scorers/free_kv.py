"""`free-kv`: the share of a node's KV cache free for a new request: its free blocks less what
the requests already waiting there for memory need (`NodeLoad.open_kv_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class FreeKvScorer:
    name: ClassVar[str] = "free-kv"
    # Score of a node that has not reported; neutral, so silence is not rewarded.
    unknown: float = 0.5

    def score(self, state: NodeState, ctx: LegContext) -> float:
        load = state.load
        if load is None or load.total_kv_blocks <= 0:
            return self.unknown
        return min(1.0, max(0.0, load.open_kv_fraction))
