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

Hard and soft filters. Hard filters (role, model, fingerprint) are
constraints of correctness. Soft ones (stale load reports, draining) are
preferences: if they leave no pair, the turn is routed by the hard filters
alone rather than failed.

The prefill leg's default picker, `least-cost`, ranks nodes by the turn's
cost on each (queue, pull, compute; see `turn_cost`), so the legs' contexts
carry the cost model, the pull rule, and the prompt matched against the
handle once per route.
"""

from __future__ import annotations

from typing import NamedTuple

from kvplane.services.common.model.nodes import Fingerprint, Node
from kvplane.services.routing.policy.config import LegPolicy, PolicyConfig
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import NoEligibleNodes, RoutePlan
from kvplane.services.routing.policy.decode_prefill import decide_from_decode_cache, decide_prefill_on_decode
from kvplane.services.routing.policy.prefix_match import PrefixMatch, match_prefix
from kvplane.services.routing.policy.pull_decision import decide_pull
from kvplane.services.routing.policy.snapshot import Leg, LegContext, NodeState, RouteSnapshot
from kvplane.services.routing.policy.turn_cost import describe_move, estimate_prefill, home_node


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


class _Chosen(NamedTuple):
    """A turn's chosen pair and what was known when it was chosen."""

    snapshot: RouteSnapshot
    holder: Node | None
    compatible: bool
    prefill: NodeState
    decode: NodeState
    costs: CostModel
    prefix: PrefixMatch | None


class RoutingPolicy:
    """A composed policy. Immutable once built; safe to share across tasks."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def rank(self, leg_policy: LegPolicy, ctx: LegContext, *, hard_only: bool = False) -> list[NodeState]:
        """The leg's eligible nodes, best first; with `hard_only`, judged by hard filters alone."""
        filters = [f for f in leg_policy.filters if f.hard] if hard_only else leg_policy.filters
        eligible = [s for s in ctx.snapshot.nodes if all(f.keep(s, ctx) for f in filters)]
        if not eligible:
            return []
        scored = [(s, sum(w.weight * w.scorer.score(s, ctx) for w in leg_policy.scorers)) for s in eligible]
        return leg_policy.picker.rank(scored, ctx)

    def _pair(
        self,
        snapshot: RouteSnapshot,
        holder: Node | None,
        fingerprint: Fingerprint | None,
        hard_only: bool,
        costs: CostModel,
        prefix: PrefixMatch | None,
    ) -> tuple[NodeState, NodeState] | None:
        pull = self.config.pull
        decode_ctx = LegContext(snapshot, Leg.DECODE, holder, fingerprint, costs, pull, prefix)
        for decode in self.rank(self.config.decode, decode_ctx, hard_only=hard_only):
            prefill_ctx = LegContext(
                snapshot, Leg.PREFILL, holder, decode.node.fingerprint, costs, pull, prefix
            )
            ranked = self.rank(self.config.prefill, prefill_ctx, hard_only=hard_only)
            if ranked:
                return ranked[0], decode
        return None

    def route(self, snapshot: RouteSnapshot, costs: CostModel | None = None) -> RoutePlan:
        """Chooses P and D and decides pull or recompute. Raises NoEligibleNodes."""
        costs = costs or self.config.cost_model
        holder = live_holder(snapshot)
        prefix = self._match(snapshot, holder)
        pair: tuple[NodeState, NodeState] | None = None
        compatible = False
        # Soft filters (liveness of load reports, draining) give way before a
        # turn fails: a stale or draining node beats no answer (DESIGN.md, invariant 5).
        for hard_only in (False, True):
            if holder is not None:
                pair = self._pair(snapshot, holder, holder.fingerprint, hard_only, costs, prefix)
                compatible = pair is not None
            if pair is None:
                pair = self._pair(snapshot, holder, None, hard_only, costs, prefix)
            if pair is not None:
                break
        if pair is None:
            raise NoEligibleNodes(f"no prefill/decode pair can serve model {snapshot.model!r}")
        prefill, decode = pair
        chosen = _Chosen(snapshot, holder, compatible, prefill, decode, costs, prefix)
        if snapshot.prefill_on_decode_ok:
            local = self._on_decode(chosen)
            if local is not None:
                return local
        verdict = decide_pull(snapshot, holder, prefill, compatible, costs, self.config.pull, prefix)
        return RoutePlan(prefill.node, decode.node, verdict, moved_from=self._moved_from(chosen))

    def _moved_from(self, chosen: _Chosen) -> str:
        """Why the turn left its home prefill node (`RoutePlan.moved_from`); "" where it did not.

        Moves are few, and each one gives up a cache hit that is sure for a saving estimated from
        loads: the estimates that decided it are what an operator needs to judge it."""
        snapshot, holder, compatible, prefill, decode, costs, prefix = chosen
        if not snapshot.prefill_cached_tokens:
            return ""
        prefills = [s for s in snapshot.nodes if s.node.role.can_prefill()]
        home = home_node(snapshot, prefills)
        if not home or home == prefill.node.node_id:
            return ""
        state = next(s for s in prefills if s.node.node_id == home)
        ctx = LegContext(
            snapshot, Leg.PREFILL, holder, decode.node.fingerprint, costs, self.config.pull, prefix
        )
        if not all(f.keep(state, ctx) for f in self.config.prefill.filters):
            return f"moved from {home}: not eligible for the turn"
        pull = self.config.pull
        return describe_move(
            estimate_prefill(snapshot, state, holder, compatible, costs, pull, prefix),
            home,
            estimate_prefill(snapshot, prefill, holder, compatible, costs, pull, prefix),
            prefill.node.node_id,
        )

    def _on_decode(self, chosen: _Chosen) -> RoutePlan | None:
        """The plan where a decode node prefills the turn itself (D is both legs: the prefill
        endpoint names it too, and nothing is pulled): from the handle the chosen D holds, else
        from the D whose own prefix cache holds the most of the prompt; None: through P."""
        snapshot, holder, compatible, prefill, decode, costs, prefix = chosen
        settings = self.config.prefill_on_decode
        if settings.max_new_tokens <= 0:
            return None
        by_handle = holder is not None and decode.node.node_id == holder.node_id
        if not by_handle and not (settings.from_decode_cache and snapshot.decode_cached_tokens):
            return None
        through = estimate_prefill(snapshot, prefill, holder, compatible, costs, self.config.pull, prefix)
        if by_handle:
            local = decide_prefill_on_decode(
                snapshot,
                holder,
                decode,
                prefix,
                through.total_ms,
                through.verdict.cached_tokens,
                costs,
                settings,
            )
            if local is not None:
                return RoutePlan(decode.node, decode.node, local)
        if not snapshot.decode_cached_tokens:
            return None
        ctx = LegContext(snapshot, Leg.DECODE, holder, None, costs, self.config.pull, prefix)
        cached = decide_from_decode_cache(
            snapshot,
            self.rank(self.config.decode, ctx),
            through.total_ms,
            through.verdict.cached_tokens,
            costs,
            settings,
        )
        if cached is None:
            return None
        state, verdict = cached
        return RoutePlan(state.node, state.node, verdict)

    def _match(self, snapshot: RouteSnapshot, holder: Node | None) -> PrefixMatch | None:
        """The prompt against the handle, when a pull is possible at all: hashing a
        prompt costs more than the rest of a route, so it is done once."""
        handle = snapshot.handle
        if handle is None or holder is None or (handle.model and handle.model != snapshot.model):
            return None
        return match_prefix(handle, snapshot.prompt, require_digests=self.config.pull.require_digests)
