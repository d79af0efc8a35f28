"""max_age: release a handle once it is older than a limit below D's TTL.

The decode engine frees a handle's blocks `engine_ttl_s` after the turn ends
on its own. Releasing `margin_s` before that keeps the control plane from
routing a pull onto blocks that are about to vanish, and frees them early.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.model import Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class MaxAge:
    """Releases handles at least `limit_s` old: min(max_age_s, engine_ttl_s - margin_s)."""

    engine_ttl_s: float = 480.0
    margin_s: float = 30.0
    max_age_s: float | None = None
    name: str = "max_age"

    def __post_init__(self) -> None:
        if self.margin_s < 0 or self.engine_ttl_s - self.margin_s <= 0:
            raise PolicyConfigError("max_age: need 0 <= margin_s < engine_ttl_s")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise PolicyConfigError("max_age: max_age_s must be positive")

    @property
    def limit_s(self) -> float:
        below_ttl = self.engine_ttl_s - self.margin_s
        return below_ttl if self.max_age_s is None else min(self.max_age_s, below_ttl)

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        limit = self.limit_s
        now = snapshot.now_unix_ms
        return [
            Release.of(h, ReleaseReason.MAX_AGE, self.name, f"age {h.age_s(now):.0f} s >= {limit:.0f} s")
            for h in snapshot.handles
            if h.age_s(now) >= limit
        ]
