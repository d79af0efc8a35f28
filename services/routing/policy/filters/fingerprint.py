"""`same-fingerprint`: nodes whose KV is interchangeable with the leg's reference.

The pipeline sets the reference: the holder's fingerprint when the handle may
be pulled, and the chosen decode node's for the prefill leg, since D reads
P's blocks. KV never moves between engines whose fingerprints differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_filter
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_filter
@dataclass(frozen=True, slots=True)
class SameFingerprintFilter:
    name: ClassVar[str] = "same-fingerprint"
    hard: ClassVar[bool] = True

    def keep(self, state: NodeState, ctx: LegContext) -> bool:
        return ctx.fingerprint is None or state.node.fingerprint == ctx.fingerprint
