"""Retention policies: pure plugins that decide which handles to release.

Entry point, shared by the eviction service and the simulator:

    from kvplane.services.eviction.policy import RetentionPipeline, Snapshot, HandleInfo, NodeInfo
    pipeline = RetentionPipeline.from_config(yaml_dict)
    releases = pipeline.evaluate(Snapshot(now_unix_ms, handles, nodes))

Each plugin lives in its own module and is named in configuration:
`max_age`, `demand`, `node_budget`, `tenant_budget`, `kv_pressure`, `low_value`. `demand`
answers a node's reported KV demand (also called directly: `RetentionPipeline.for_demand`),
least expected reuse per byte first. Budgets release the
lowest-value handles first, valued by `value.ValueModel` from online gap
statistics (`gaps.GapStatistics`, fed by `gaps.TurnTracker`). Every
`Release` carries a reason and a detail. No module here does I/O or reads
the clock.
"""

from kvplane.services.eviction.policy.base import PolicyConfigError, RetentionPolicy
from kvplane.services.eviction.policy.gaps import GapPrior, GapStatistics, TurnTracker
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Release, Snapshot
from kvplane.services.eviction.policy.pipeline import RetentionPipeline, build_policy
from kvplane.services.eviction.policy.value import ValueModel, ValueParams

__all__ = [
    "GapPrior",
    "GapStatistics",
    "HandleInfo",
    "NodeInfo",
    "PolicyConfigError",
    "Release",
    "RetentionPipeline",
    "RetentionPolicy",
    "Snapshot",
    "TurnTracker",
    "ValueModel",
    "ValueParams",
    "build_policy",
]
