"""`max-score`: ranks nodes by weighted score, best first.

Ties are broken by a hash of (conversation, node id), salted with the routing
replica's id when it has one: deterministic for a given turn, yet spread
across equal nodes for different conversations and different replicas.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_picker
from kvplane.services.routing.policy.snapshot import LegContext, NodeState, RouteSnapshot


def tie_key(snapshot: RouteSnapshot, node_id: str) -> int:
    """A keyed hash of the node for this conversation (and replica), to order equal nodes."""
    # A keyed hash, not a CRC: a CRC's order of equal-length ids would not
    # depend on the conversation at all.
    data = (
        snapshot.conversation.encode("utf-8", "surrogatepass")
        + b"\0"
        + node_id.encode("utf-8", "surrogatepass")
    )
    if snapshot.tie_salt:
        data = snapshot.tie_salt.encode("utf-8", "surrogatepass") + b"\0" + data
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@register_picker
@dataclass(frozen=True, slots=True)
class MaxScorePicker:
    name: ClassVar[str] = "max-score"

    def rank(self, scored: Sequence[tuple[NodeState, float]], ctx: LegContext) -> list[NodeState]:
        snapshot = ctx.snapshot

        def key(item: tuple[NodeState, float]) -> tuple[float, int, str]:
            state, score = item
            node_id = state.node.node_id
            return (-score, tie_key(snapshot, node_id), node_id)

        return [state for state, _ in sorted(scored, key=key)]
