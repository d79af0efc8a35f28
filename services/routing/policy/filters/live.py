"""`live`: nodes whose load reports have not stopped.

A registered node's lease is alive by construction (the view drops a node
when its lease ends): liveness is the lease, not the age of a load report.
The node agent reports load when it changes, and otherwise only every
`load_heartbeat_s` (10 s), so a quiet idle node's last report may be that
old. A node whose reports stopped for longer than three heartbeats while its
lease lives is wedged, not dead: its agent thread still keeps the lease.
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
    # A load report older than this, in ms, marks the node as stuck: three of the node agent's
    # load heartbeats (`NodeAgentSettings.load_heartbeat_s`, 10 s), so a quiet node is not.
    max_load_age_ms: int = 30_000
    # Whether a node that has never reported load may take turns.
    require_load: bool = False

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        if state.load is None:
            return not self.require_load
        snapshot = ctx.snapshot
        as_of = snapshot.loads_as_of_unix_ms or snapshot.now_unix_ms
        return as_of - state.load.reported_unix_ms <= self.max_load_age_ms
