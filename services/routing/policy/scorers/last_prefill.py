"""`last-prefill-affinity`: the prefill node that served the conversation's previous turn.

Its local prefix cache may still hold the history, which cuts what must be
pulled or recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class LastPrefillScorer:
    name: ClassVar[str] = "last-prefill-affinity"

    def score(self, state: NodeState, ctx: LegContext) -> float:
        last = ctx.snapshot.last_prefill_node_id
        return 1.0 if last and state.node.node_id == last else 0.0
