"""`holder-affinity`: the decode node that retains the conversation's KV, if it has room.

D's prefix cache still holds the history after P reads the handle, so the
P->D transfer is only the new suffix. That only helps if the holder can
take the suffix and the answer without preempting: it needs free KV for the
prompt's new tokens plus `reserve_tokens` for the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class HolderAffinityScorer:
    name: ClassVar[str] = "holder-affinity"
    # Tokens of output to leave room for, beyond the prompt's new tokens.
    reserve_tokens: int = 1024
    # Free share of the KV cache below which the holder counts as full.
    min_free_fraction: float = 0.02

    def score(self, state: NodeState, ctx: LegContext) -> float:
        holder = ctx.holder
        handle = ctx.snapshot.handle
        if holder is None or handle is None:
            return 0.0
        if state.node.node_id != holder.node_id or state.node.incarnation != holder.incarnation:
            return 0.0
        load = state.load
        if load is None or load.total_kv_blocks <= 0:
            return 1.0  # unknown headroom: the holder is still the best guess
        if load.open_kv_fraction < self.min_free_fraction:
            return 0.0
        needed = max(0, ctx.snapshot.prompt.tokens - handle.num_tokens) + self.reserve_tokens
        return 1.0 if state.fits(needed) else 0.0
