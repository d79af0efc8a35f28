"""`max-score`: ranks nodes by weighted score, best first.

Ties are broken by a hash of (conversation, node id): deterministic for a
given turn, yet spread across equal nodes for different conversations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_picker
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_picker
@dataclass(frozen=True, slots=True)
class MaxScorePicker:
    name: ClassVar[str] = "max-score"

    def rank(self, scored: Sequence[tuple[NodeState, float]], ctx: LegContext) -> list[NodeState]:
        salt = ctx.snapshot.conversation.encode("utf-8", "surrogatepass")

        def key(item: tuple[NodeState, float]) -> tuple[float, int, str]:
            state, score = item
            node_id = state.node.node_id
            # A keyed hash, not a CRC: a CRC's order of equal-length ids would not
            # depend on the conversation at all.
            spread = hashlib.blake2b(salt + b"\0" + node_id.encode("utf-8", "surrogatepass"), digest_size=8)
            return (-score, int.from_bytes(spread.digest(), "little"), node_id)

        return [state for state, _ in sorted(scored, key=key)]
