"""kvplane's routing policy: small pure plugins composed by name.

Entry point (used by the routing service and by the simulator in-process)::

    from kvplane.services.routing.policy import RoutingPolicy, RouteSnapshot, load_policy

    policy = RoutingPolicy(load_policy())            # packaged default_policy.yaml
    plan = policy.route(snapshot, cost_model)        # -> RoutePlan(prefill, decode, verdict)

Inputs are frozen dataclasses (`RouteSnapshot`, `NodeState`, `Prompt`, the
domain `Node`, `NodeLoad`, `CacheHandle`); time is `snapshot.now_unix_ms`.
`CostModel.observe(TurnObservation)` returns the model updated with a turn.
"""

from kvplane.services.routing.policy.config import (
    LegPolicy,
    PolicyConfig,
    load_policy,
    policy_from_mapping,
    policy_from_yaml,
)
from kvplane.services.routing.policy.cost_model import CostModel, TurnObservation
from kvplane.services.routing.policy.decision import Decision, NoEligibleNodes, PullVerdict, RoutePlan
from kvplane.services.routing.policy.pipeline import RoutingPolicy, live_holder
from kvplane.services.routing.policy.pull_decision import PullSettings, decide_pull
from kvplane.services.routing.policy.registry import PolicyConfigError
from kvplane.services.routing.policy.snapshot import Leg, LegContext, NodeState, Prompt, RouteSnapshot

__all__ = [
    "CostModel",
    "Decision",
    "Leg",
    "LegContext",
    "LegPolicy",
    "NoEligibleNodes",
    "NodeState",
    "PolicyConfig",
    "PolicyConfigError",
    "Prompt",
    "PullSettings",
    "PullVerdict",
    "RoutePlan",
    "RouteSnapshot",
    "RoutingPolicy",
    "TurnObservation",
    "decide_pull",
    "live_holder",
    "load_policy",
    "policy_from_mapping",
    "policy_from_yaml",
]
