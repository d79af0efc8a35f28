"""`not-draining`: nodes that have not asked to be drained."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_filter
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_filter
@dataclass(frozen=True, slots=True)
class NotDrainingFilter:
    name: ClassVar[str] = "not-draining"
    hard: ClassVar[bool] = False

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        return not state.node.draining
