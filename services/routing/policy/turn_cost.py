"""`least-cost`: prefill nodes ranked by what the turn would cost on each.

The cost of a turn on a candidate P, in ms, is its queue (the prefill work
it already has: its last load report plus what was routed to it since, each
request with its fixed cost) plus the pull the turn would make there plus
the turn's own prefill (`CostModel.prefill_ms`): one fixed cost, the tokens
it must compute (the prompt, minus what P's prefix cache is believed to
hold, minus what it pulls), and the tokens it reuses, which are cheaper but
not free. The pull is decided per node by the same rule the plan uses
(`pull_decision`), so a node that holds the history wins over one that would
pull it, and one that would pull it over one that would recompute it, each
by the time it saves and no more.

Equal costs (idle nodes without a cached prefix) fall back to the leg's
scorers, then to a keyed hash of (tie salt, conversation, node id): spread
across conversations and across routing replicas, never piled onto the one
node that sorts first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.common.nodes import Node
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import PullVerdict
from kvplane.services.routing.policy.picker import tie_key
from kvplane.services.routing.policy.prefix_match import PrefixMatch
from kvplane.services.routing.policy.pull_decision import PullSettings, decide_pull
from kvplane.services.routing.policy.registry import register_picker
from kvplane.services.routing.policy.snapshot import LegContext, NodeState, RouteSnapshot


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    """A turn on one prefill node: the pull verdict there and its cost (ms, tokens)."""

    verdict: PullVerdict
    queue_ms: float
    compute_tokens: int
    total_ms: float


def estimate_prefill(
    snapshot: RouteSnapshot,
    state: NodeState,
    holder: Node | None,
    compatible: bool,
    costs: CostModel,
    settings: PullSettings,
    match: PrefixMatch | None = None,
) -> PrefillEstimate:
    verdict = decide_pull(snapshot, holder, state, compatible, costs, settings, match)
    queue = costs.queue_ms(state)
    pulls = verdict.decision.pulls
    covered = max(verdict.cached_tokens, verdict.reusable_tokens if pulls else 0)
    compute = max(1, snapshot.prompt.tokens - covered)
    transfer = verdict.transfer_ms if pulls else 0.0
    return PrefillEstimate(verdict, queue, compute, queue + transfer + costs.prefill_ms(compute, covered))


@register_picker
@dataclass(frozen=True, slots=True)
class LeastCostPicker:
    name: ClassVar[str] = "least-cost"

    def rank(self, scored: Sequence[tuple[NodeState, float]], ctx: LegContext) -> list[NodeState]:
        snapshot = ctx.snapshot
        costs = ctx.costs or CostModel()
        settings = ctx.pull or PullSettings()
        holder = ctx.holder
        compatible = holder is not None and ctx.fingerprint == holder.fingerprint

        def key(item: tuple[NodeState, float]) -> tuple[float, float, int, str]:
            state, score = item
            total = estimate_prefill(
                snapshot, state, holder, compatible, costs, settings, ctx.prefix
            ).total_ms
            node_id = state.node.node_id
            return (total, -score, tie_key(snapshot, node_id), node_id)

        return [state for state, _ in sorted(scored, key=key)]
