"""`running-load`: fewer running and queued requests score higher.

1 / (1 + (running + queued) / scale): halves at `scale` requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvplane.services.routing.policy.registry import register_scorer
from kvplane.services.routing.policy.snapshot import LegContext, NodeState


@register_scorer
@dataclass(frozen=True, slots=True)
class RunningLoadScorer:
    name: ClassVar[str] = "running-load"
    # Requests at which the score halves.
    scale: float = 16.0
    unknown: float = 0.5

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError("scale must be positive")

    def score(self, state: NodeState, ctx: LegContext) -> float:
        load = state.load
        if load is None:
            return self.unknown
        return 1.0 / (1.0 + (load.running_requests + load.queued_requests) / self.scale)
