"""`live`: nodes whose load reports are fresh.

A registered node's lease is alive by construction (the view drops a node
when its lease ends). A node that stopped reporting load while its lease
lives is wedged, not dead: its agent thread still keeps the lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_filter
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_filter
@dataclass(frozen=True, slots=True)
class LiveFilter:
    name: ClassVar[str] = "live"
    hard: ClassVar[bool] = False
    # A load report older than this, in ms, marks the node as stuck.
    max_load_age_ms: int = 10_000
    # Whether a node that has never reported load may take turns.
    require_load: bool = False

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        if state.load is None:
            return not self.require_load
        snapshot = ctx.snapshot
        as_of = snapshot.loads_as_of_unix_ms or snapshot.now_unix_ms
        return as_of - state.load.reported_unix_ms <= self.max_load_age_ms
