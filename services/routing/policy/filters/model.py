"""`same-model`: nodes that serve the requested model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_filter
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_filter
@dataclass(frozen=True, slots=True)
class SameModelFilter:
    name: ClassVar[str] = "same-model"
    hard: ClassVar[bool] = True

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        return state.node.fingerprint.model == ctx.snapshot.model
