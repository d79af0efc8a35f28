"""`role`: nodes that can serve the leg being chosen (BOTH serves either)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_filter
from kvplane.services.routing.policy.snapshot import Leg, LegContext, NodeState


@register_filter
@dataclass(frozen=True, slots=True)
class RoleFilter:
    name: ClassVar[str] = "role"
    hard: ClassVar[bool] = True

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        role = state.node.role
        return role.can_prefill() if ctx.leg is Leg.PREFILL else role.can_decode()
