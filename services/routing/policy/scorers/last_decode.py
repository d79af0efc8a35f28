"""`last-decode-affinity`: the decode node that served the conversation's previous turn.

A decode engine with prefix caching keeps the blocks of a finished request in its cache until
they are evicted, retained as a handle or not: D reads only the blocks it lacks from P, so on the
last D the P->D transfer of a later turn is about the new suffix, and on the other D the whole
history. A conversation that stays also keeps each D's admissions in the order its prefills
arrive; one that moves each turn lands on a D beside other turns from the other P, and waits
there.

The weight (against `free-kv` and `running-load`, about 0.04 per request on a D running 16)
says how much imbalance staying is worth: a conversation moves once the other D has a few
requests fewer, not for one. Only a last D with room for the new tokens and the output scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class LastDecodeScorer:
    name: ClassVar[str] = "last-decode-affinity"
    # Tokens of output to leave room for, beyond the prompt.
    reserve_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.reserve_tokens < 0:
            raise ValueError("reserve_tokens must not be negative")

    def score(self, state: NodeState, ctx: LegContext) -> float:
        last = ctx.snapshot.last_decode_node_id
        if not last or state.node.node_id != last:
            return 0.0
        # The whole prompt, at worst: D's cache may have lost the history. Unknown headroom: the
        # last D is still the best guess.
        return 1.0 if state.fits(ctx.snapshot.prompt.tokens + self.reserve_tokens) else 0.0
