"""The order in which a node with a host tier moves its retained handles there, and drops them.

A decode engine short of KV blocks moves retained handles to its host memory itself, at once,
without a round trip to the leader (a turn must not wait for one). Which handles it moves is the
leader's call, though: the leader alone knows each conversation's gap statistics, hence what a
handle is worth. So the leader sends each such node its order ahead of need (a `SpillOrder` on
the node's command stream): its device handles least expected reuse per byte first (the order in
which a demand releases them), and its host handles in the same order, the first to drop when
host memory is full.

A node orders the handles an order does not name after those it does, oldest first; so an order
is sent only when the node would do materially worse with the last one sent (none, on a new
stream): when, at some rank, the handle it would take is worth more than `WORTH_SENDING` above
the one the leader would (`TierOrder.followed_after`). Where value follows age (one tenant,
turns that come back soon or not at all), nothing is sent: age order is within that of the
value order, whose differences there are a part-filled last block's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.services.eviction.policy.model import HandleInfo, Snapshot
from kvplane.services.eviction.policy.value import ValueModel

# How much more a handle the node would move (or drop) at some rank may be worth than the leader's
# choice at that rank before an order is worth sending: expected reuse per byte, relative.
WORTH_SENDING = 0.05


@dataclass(frozen=True, slots=True)
class TierOrder:
    """One tier of one node: the leader's order (at most its cap) and every handle it holds there."""

    order: tuple[str, ...] = ()
    # vLLM request ids of every handle of the tier, oldest first: how the node orders what an
    # order leaves out.
    held: tuple[str, ...] = ()
    # Each held handle's expected reuse per byte (a missing one counts as worth nothing).
    worth: Mapping[str, float] = field(default_factory=dict)

    def followed_after(self, sent: Sequence[str]) -> bool:
        """True when a node that was last sent `sent` already acts about as `order` says.

        The node takes the ids of `sent` it still holds first, in that order, then the rest
        oldest first. At each of the first `len(order)` ranks, what it would take must be worth
        at most `WORTH_SENDING` more than the leader's choice there.
        """
        held = set(self.held)
        named = set(sent)
        effective = [i for i in sent if i in held] + [i for i in self.held if i not in named]
        worth = self.worth
        return all(
            worth.get(took, 0.0) <= worth.get(best, 0.0) * (1 + WORTH_SENDING)
            for took, best in zip(effective, self.order, strict=False)
        )


@dataclass(frozen=True, slots=True)
class NodeSpillOrder:
    """One node's order: vLLM request ids, the first to move (device) or drop (host) first."""

    device: TierOrder = TierOrder()
    host: TierOrder = TierOrder()


def spill_orders(
    snapshot: Snapshot,
    values: ValueModel,
    request_ids: Mapping[str, str],
    max_ids: int,
    nodes: frozenset[str] | set[str],
) -> dict[str, NodeSpillOrder]:
    """Each of `nodes`' order: at most `max_ids` handles per tier, from the snapshot's handles.

    `request_ids` maps a handle id to its vLLM request id on its holder; a handle without one is
    left out (the node orders it by age).
    """
    by_node: dict[str, dict[bool, list[HandleInfo]]] = defaultdict(lambda: {True: [], False: []})
    for h in snapshot.handles:
        if h.node_id in nodes and h.handle_id in request_ids:
            by_node[h.node_id][h.on_device].append(h)
    out = {node_id: NodeSpillOrder() for node_id in nodes}
    for node_id, tiers in by_node.items():
        device, host = (
            TierOrder(
                tuple(
                    request_ids[h.handle_id]
                    for h in values.least_reuse_per_byte_first(tiers[on_device], snapshot)[:max_ids]
                ),
                tuple(
                    request_ids[h.handle_id]
                    for h in sorted(tiers[on_device], key=lambda h: (h.published_unix_ms, h.handle_id))
                ),
                {request_ids[h.handle_id]: values.reuse_per_byte(h, snapshot) for h in tiers[on_device]},
            )
            for on_device in (True, False)
        )
        out[node_id] = NodeSpillOrder(device, host)
    return out
