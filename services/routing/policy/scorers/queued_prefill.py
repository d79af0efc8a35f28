"""`queued-prefill`: fewer prompt tokens waiting on a prefill node score higher.

Queued prefill tokens are the queueing delay a new prompt will see, which
is what prefill choice is about. 1 / (1 + queued / scale_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class QueuedPrefillScorer:
    name: ClassVar[str] = "queued-prefill"
    # Queued tokens at which the score halves.
    scale_tokens: float = 8192.0
    unknown: float = 0.5

    def __post_init__(self) -> None:
        if self.scale_tokens <= 0:
            raise ValueError("scale_tokens must be positive")

    def score(self, state: NodeState, ctx: LegContext) -> float:
        load = state.load
        if load is None:
            return self.unknown
        return 1.0 / (1.0 + load.queued_prefill_tokens / self.scale_tokens)
