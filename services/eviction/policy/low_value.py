"""low_value: release handles whose expected benefit is below their holding cost.

Unlike the budgets this acts without memory pressure: a conversation idle far
past its tenant's usual gaps is unlikely to return before its deadline, and
its blocks are better spent on live requests (see `value.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.model import Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class LowValue:
    """Releases when benefit < `min_ratio` x cost, once a handle is `min_age_s` old."""

    min_ratio: float = 1.0
    # Young handles are kept whatever the arithmetic says: their turn's
    # successor is most likely right now.
    min_age_s: float = 10.0
    name: str = "low_value"

    def __post_init__(self) -> None:
        if self.min_ratio < 0 or self.min_age_s < 0:
            raise PolicyConfigError("low_value: min_ratio and min_age_s must be >= 0")

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        out: list[Release] = []
        now = snapshot.now_unix_ms
        for h in snapshot.handles:
            if h.age_s(now) < self.min_age_s:
                continue
            v = values.value(h, snapshot)
            if v.benefit_s < self.min_ratio * v.cost_s:
                detail = (
                    f"benefit {v.benefit_s:.3f} s (P={v.p_return:.3f})"
                    f" < {self.min_ratio:g} x cost {v.cost_s:.3f} s"
                )
                out.append(Release.of(h, ReleaseReason.LOW_VALUE, self.name, detail))
        return out
