"""The routing policy: filter -> score -> pick for each leg, then pull or recompute.

This is the entry point shared by the routing service and the simulator::

    policy = RoutingPolicy(load_policy())          # or policy_from_mapping({...})
    plan = policy.route(snapshot, cost_model)      # RoutePlan: prefill, decode, verdict

`route` is pure and deterministic: no I/O, no clock reads, no randomness; the
same snapshot and cost model always give the same plan.

Fingerprints. A pull needs P to share the holder's fingerprint, and D reads
P's blocks, so D must share P's. When the handle's holder is live, both legs
are first chosen among nodes with the holder's fingerprint; if that leaves
no P/D pair the turn is routed without it and recomputes.
"""

from __future__ import annotations

from kvplane.services.common.nodes import Fingerprint, Node
from kvplane.services.routing.policy.config import LegPolicy, PolicyConfig
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import NoEligibleNodes, RoutePlan
from kvplane.services.routing.policy.pull_decision import decide_pull
from kvplane.services.routing.policy.snapshot import Leg, LegContext, NodeState, RouteSnapshot


def live_holder(snapshot: RouteSnapshot) -> Node | None:
    """The handle's holder, if it is registered with the handle's incarnation and not draining."""
    handle = snapshot.handle
    if handle is None:
        return None
    for state in snapshot.nodes:
        node = state.node
        if node.node_id == handle.holder_node_id:
            if node.incarnation != handle.holder_incarnation or node.draining or not node.role.can_decode():
                return None
            return node
    return None


class RoutingPolicy:
    """A composed policy. Immutable once built; safe to share across tasks."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def rank(self, leg_policy: LegPolicy, ctx: LegContext) -> list[NodeState]:
        """The leg's eligible nodes, best first."""
        eligible = [s for s in ctx.snapshot.nodes if all(f.keep(s, ctx) for f in leg_policy.filters)]
        if not eligible:
            return []
        scored = [(s, sum(w.weight * w.scorer.score(s, ctx) for w in leg_policy.scorers)) for s in eligible]
        return leg_policy.picker.rank(scored, ctx)

    def _pair(
        self, snapshot: RouteSnapshot, holder: Node | None, fingerprint: Fingerprint | None
    ) -> tuple[NodeState, NodeState] | None:
        decode_ctx = LegContext(snapshot, Leg.DECODE, holder, fingerprint)
        for decode in self.rank(self.config.decode, decode_ctx):
            prefill_ctx = LegContext(snapshot, Leg.PREFILL, holder, decode.node.fingerprint)
            ranked = self.rank(self.config.prefill, prefill_ctx)
            if ranked:
                return ranked[0], decode
        return None

    def route(self, snapshot: RouteSnapshot, costs: CostModel | None = None) -> RoutePlan:
        """Chooses P and D and decides pull or recompute. Raises NoEligibleNodes."""
        costs = costs or self.config.cost_model
        holder = live_holder(snapshot)
        pair = self._pair(snapshot, holder, holder.fingerprint) if holder is not None else None
        compatible = pair is not None
        if pair is None:
            pair = self._pair(snapshot, holder, None)
        if pair is None:
            raise NoEligibleNodes(f"no prefill/decode pair can serve model {snapshot.model!r}")
        prefill, decode = pair
        verdict = decide_pull(snapshot, holder, prefill, compatible, costs, self.config.pull)
        return RoutePlan(prefill.node, decode.node, verdict)
