"""Composes retention plugins, configured by name, into one decision.

Configuration is plain data (as parsed from YAML):

    policies:
      - name: max_age
        engine_ttl_s: 1800
        margin_s: 60
      - name: tenant_budget
        default_bytes: 68719476736
        tenants: {acme: 17179869184}
      - name: node_budget
        high_fraction: 0.5
        low_fraction: 0.4
      - name: kv_pressure
        low_free_fraction: 0.05
        target_free_fraction: 0.15
      - name: demand
      - name: low_value
        min_ratio: 1.0
    value:
      prefill_tokens_per_s: 8000
      holding_cost: 0.01
    gaps:
      quantiles: {0.1: 42, 0.5: 126, 0.9: 486}
      global_weight: 200
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvplane.services.eviction.policy.base import PolicyConfigError, RetentionPolicy
from kvplane.services.eviction.policy.demand import OnDemand
from kvplane.services.eviction.policy.gaps import GapPrior, GapStatistics
from kvplane.services.eviction.policy.kv_pressure import KvPressure
from kvplane.services.eviction.policy.low_value import LowValue
from kvplane.services.eviction.policy.max_age import MaxAge
from kvplane.services.eviction.policy.model import Release, Snapshot
from kvplane.services.eviction.policy.node_budget import NodeBudget
from kvplane.services.eviction.policy.tenant_budget import TenantBudget
from kvplane.services.eviction.policy.value import ValueModel, ValueParams

PLUGINS: Mapping[str, Callable[..., RetentionPolicy]] = {
    "max_age": MaxAge,
    "node_budget": NodeBudget,
    "tenant_budget": TenantBudget,
    "low_value": LowValue,
    "kv_pressure": KvPressure,
    "demand": OnDemand,
}

# Without configuration: release before D's default TTL, give a node the
# memory its waiting requests ask for (in value order, no more than asked), and
# drop what is worth less than it costs. No headroom is kept empty in advance
# (`node_budget` and `kv_pressure` watermarks): it costs reuse and buys nothing
# the on-demand path does not. Node and tenant budgets remain as limits for
# fleets that want them.
DEFAULT_CONFIG: Mapping[str, Any] = {
    "policies": [
        {"name": "max_age", "engine_ttl_s": 480, "margin_s": 30},
        {"name": "demand"},
        {"name": "low_value", "min_ratio": 1.0},
    ]
}


@dataclass(frozen=True, slots=True)
class RetentionPipeline:
    """Runs each policy in order; each sees what the earlier ones left.

    This is the entry point the service and the simulator share:

        pipeline = RetentionPipeline.from_config(config)   # or build it directly
        pipeline.values.gaps.observe_gap(tenant, gap_s)    # learn (or TurnTracker)
        releases = pipeline.evaluate(Snapshot(now_ms, handles, nodes))

    `evaluate` is pure for given gap statistics: no I/O, no clock.
    """

    policies: tuple[RetentionPolicy, ...]
    values: ValueModel

    @property
    def on_demand(self) -> OnDemand | None:
        """The `demand` plugin, which nodes' demand reports also call directly; None: not configured."""
        return next((p for p in self.policies if isinstance(p, OnDemand)), None)

    def for_demand(self, snapshot: Snapshot, node_id: str) -> list[Release]:
        """Releases that answer `node_id`'s demand now (the immediate path of a demand report)."""
        policy = self.on_demand
        return [] if policy is None else policy.for_node(snapshot, node_id, self.values)

    def evaluate(self, snapshot: Snapshot) -> list[Release]:
        chosen: dict[tuple[str, str], Release] = {}
        for policy in self.policies:
            remaining = snapshot.without(chosen) if chosen else snapshot
            for release in policy.evaluate(remaining, self.values):
                chosen.setdefault(release.key, release)
        return list(chosen.values())

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None = None) -> RetentionPipeline:
        config = DEFAULT_CONFIG if config is None else config
        unknown = set(config) - {"policies", "value", "gaps"}
        if unknown:
            raise PolicyConfigError(f"unknown policy config sections: {sorted(unknown)}")
        policies = tuple(build_policy(entry) for entry in config.get("policies", ()))
        gaps = GapStatistics(_build(GapPrior, dict(config.get("gaps") or {}), "gaps"))
        values = ValueModel(gaps, _build(ValueParams, dict(config.get("value") or {}), "value"))
        return cls(policies, values)


def build_policy(entry: Mapping[str, Any]) -> RetentionPolicy:
    """One plugin from `{"name": ..., **settings}`."""
    settings = dict(entry)
    name = settings.pop("name", None)
    factory = PLUGINS.get(str(name))
    if factory is None:
        raise PolicyConfigError(f"unknown retention policy {name!r}; known: {sorted(PLUGINS)}")
    try:
        return factory(**settings)
    except TypeError as exc:
        raise PolicyConfigError(f"{name}: {exc}") from exc


def _build(cls: Callable[..., Any], settings: dict[str, Any], section: str) -> Any:
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(settings) - known
    if unknown:
        raise PolicyConfigError(f"{section}: unknown settings {sorted(unknown)}")
    if "quantiles" in settings:
        settings["quantiles"] = {float(q): float(v) for q, v in settings["quantiles"].items()}
    try:
        return cls(**settings)
    except (TypeError, ValueError) as exc:
        raise PolicyConfigError(f"{section}: {exc}") from exc
