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

A conversation stays on its home node (the one believed to hold the most of
its prompt in its prefix cache) unless moving saves more than
`move_margin_ms` beyond the pull the move costs. The estimates that argue
for a move are uncertain by about one request's prefill: a load report
samples a running request part-way, the work routed since is an estimate,
and the learned cost model follows a noisy engine. A move on less than that
trades a cache hit that is sure for a saving that may not be there, and it
leaves a stale copy on the home node while filling the new node's cache.

A move also makes the fleet do more: the new node computes what the home
node's cache held (all of it when there is no handle to pull; pulled tokens
cost what cached ones do). The turn's own cost counts that once, but every
turn that queues behind it on the new node waits for it too, while the home
node is spared only the cheap prefill. So a move must also save
`extra_work_weight` times the compute it adds (one follower's wait by
default). Without this, a wave of turns that arrive together (chats that
advance in step) moves the conversations whose home's queue is a few turns
longer, recomputes their histories and lengthens the queues it meant to
shorten; on a bursty fleet, where a home is seconds behind, a move still
pays many times over.

A conversation that no node holds any of (its first turn, or one whose history every cache has
dropped) is placed for all its later turns too: they will queue behind those of the
conversations already there. So it goes to the node with the fewest active conversations
(`RouteSnapshot.prefill_homes`: the others whose last turn it served lately) among the nodes
whose cost for this turn is within `placement_margin_ms` of the cheapest, then to the cheapest
of those. The nodes then keep even shares of the conversations in flight, as vllm-router's rule
of sending a request with no cached prefix to the worker with the smallest cache does; ranked
by this turn's cost alone, a first turn that finds the other node a little behind joins the
node of the conversation before it, and conversations that advance in step then bring their
later turns to that node together. A saving of more than the margin still wins: a node that is
seconds behind takes no new conversations.

A move carries the conversation's later turns with it just as a placement does. So a move to a
node home to at least as many other active conversations as the one it leaves, which leaves the
fleet less even than it found it, must also save `placement_margin_ms`: the saving a new
conversation needs to be placed there. Without this, one wave that queued two turns on a node
moves a conversation whose every later turn then lengthens the other node's waves.

Equal costs otherwise fall back to the leg's scorers, then to the node that served the
conversation's previous turn, then to the node fewer of the other active conversations call
home, then to the node sent a turn least lately (so that new conversations arriving on an idle
fleet, where every cost is equal, still alternate), then to a keyed hash of (tie salt,
conversation, node id): never piled onto the one node that sorts first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.common.model.nodes import Node
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


def describe_move(home: PrefillEstimate, home_id: str, chosen: PrefillEstimate, chosen_id: str) -> str:
    """Why a turn left its home node, in the estimates that decided it (ms)."""
    return f"moved from {home_id} ({_terms(home)}) to {chosen_id} ({_terms(chosen)})"


def _terms(estimate: PrefillEstimate) -> str:
    pull = estimate.verdict.transfer_ms if estimate.verdict.decision.pulls else 0.0
    prefill = estimate.total_ms - estimate.queue_ms - pull
    queue, total = estimate.queue_ms, estimate.total_ms
    return f"queue {queue:.0f} + pull {pull:.0f} + prefill {prefill:.0f} = {total:.0f} ms"


def home_node(snapshot: RouteSnapshot, candidates: Sequence[NodeState]) -> str:
    """The candidate believed to hold the most of the prompt ("" if none holds any).

    Equal holdings go to the node that served the conversation's previous turn.
    """
    held = snapshot.prefill_cached_tokens
    best, best_key = "", (0, False)
    for state in candidates:
        node_id = state.node.node_id
        key = (held.get(node_id, 0), node_id == snapshot.last_prefill_node_id)
        if key[0] > 0 and key > best_key:
            best, best_key = node_id, key
    return best


@register_picker
@dataclass(frozen=True, slots=True)
class LeastCostPicker:
    name: ClassVar[str] = "least-cost"
    # What a move off the home node must save beyond its pull, in ms (see the module's docstring).
    move_margin_ms: float = 100.0
    # What a move must save per ms of compute it adds to the fleet (see the module's docstring).
    extra_work_weight: float = 1.0
    # How much dearer than the cheapest node a less loaded one may be for a conversation that no
    # node holds any of, in ms (see the module's docstring).
    placement_margin_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.move_margin_ms < 0:
            raise ValueError("move_margin_ms must not be negative")
        if self.extra_work_weight < 0:
            raise ValueError("extra_work_weight must not be negative")
        if self.placement_margin_ms < 0:
            raise ValueError("placement_margin_ms must not be negative")

    def rank(self, scored: Sequence[tuple[NodeState, float]], ctx: LegContext) -> list[NodeState]:
        snapshot = ctx.snapshot
        costs = ctx.costs or CostModel()
        settings = ctx.pull or PullSettings()
        holder = ctx.holder
        compatible = holder is not None and ctx.fingerprint == holder.fingerprint
        home = home_node(snapshot, [state for state, _ in scored])
        estimates = {
            state.node.node_id: estimate_prefill(
                snapshot, state, holder, compatible, costs, settings, ctx.prefix
            )
            for state, _ in scored
        }
        home_work = _work_ms(estimates[home]) if home else 0.0

        homes = snapshot.prefill_homes
        order = snapshot.prefill_routed_order
        last = snapshot.last_prefill_node_id
        cheapest = min(estimate.total_ms for estimate in estimates.values()) if estimates else 0.0

        def key(item: tuple[NodeState, float]) -> tuple[bool, int, float, float, bool, int, int, int, str]:
            state, score = item
            node_id = state.node.node_id
            estimate = estimates[node_id]
            total = estimate.total_ms
            others = homes.get(node_id, 0)
            placed = (False, 0)
            if not home:
                placed = (total > cheapest + self.placement_margin_ms, others)
            elif node_id != home:
                extra = max(0.0, _work_ms(estimate) - home_work)
                total += self.move_margin_ms + self.extra_work_weight * extra
                if others >= homes.get(home, 0):
                    total += self.placement_margin_ms
            return (
                *placed,
                total,
                -score,
                node_id != last,
                others,
                order.get(node_id, 0),
                tie_key(snapshot, node_id),
                node_id,
            )

        return [state for state, _ in sorted(scored, key=key)]


def _work_ms(estimate: PrefillEstimate) -> float:
    """The compute the turn adds to a node's queue there (ms): its prefill, without the queue or the pull."""
    transfer = estimate.verdict.transfer_ms if estimate.verdict.decision.pulls else 0.0
    return estimate.total_ms - estimate.queue_ms - transfer
