"""tenant_budget: cap the bytes each tenant keeps retained across the fleet.

One tenant's idle conversations must not crowd out everyone else's. When a
tenant's retained bytes exceed its budget, its lowest-value handles are
released until it is at or under `low_ratio` of the budget.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.model import HandleInfo, Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


@dataclass(frozen=True, slots=True)
class TenantBudget:
    """`tenants` maps a tenant to its budget in bytes; others get `default_bytes`
    (None: unlimited)."""

    tenants: Mapping[str, int] = field(default_factory=dict)
    default_bytes: int | None = None
    low_ratio: float = 0.9
    name: str = "tenant_budget"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))
        if not 0 <= self.low_ratio <= 1:
            raise PolicyConfigError("tenant_budget: low_ratio must be within [0, 1]")
        if any(b < 0 for b in self.tenants.values()) or (
            self.default_bytes is not None and self.default_bytes < 0
        ):
            raise PolicyConfigError("tenant_budget: budgets must be >= 0 bytes")

    def budget(self, tenant: str) -> int | None:
        return self.tenants.get(tenant, self.default_bytes)

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        by_tenant: dict[str, list[HandleInfo]] = defaultdict(list)
        for h in snapshot.handles:
            by_tenant[h.tenant].append(h)
        out: list[Release] = []
        for tenant in sorted(by_tenant):
            budget = self.budget(tenant)
            if budget is None:
                continue
            handles = by_tenant[tenant]
            retained = sum(h.retained_bytes for h in handles)
            if retained <= budget:
                continue
            target = budget * self.low_ratio
            detail = f"tenant {tenant} retained {retained} B > budget {budget} B; down to {target:.0f} B"
            for h in values.lowest_value_first(handles, snapshot):
                if retained <= target:
                    break
                out.append(Release.of(h, ReleaseReason.TENANT_BUDGET, self.name, detail))
                retained -= h.retained_bytes
        return out
