"""A routing decision: which decisions pull, how much a pull moves, and that each has its wire name."""

from __future__ import annotations

import pytest

from kvplane.services.routing.policy.decision import Decision, NoEligibleNodes, PullVerdict, RoutePlan
from kvplane.v1 import routing_pb2
from tests.unit.routing_policy_fixtures import mk_node


def test_only_the_two_pull_decisions_pull() -> None:
    assert {d for d in Decision if d.pulls} == {Decision.PULL, Decision.PULL_PREFIX}


def test_every_decision_has_its_namesake_in_routing_proto() -> None:
    wire = set(routing_pb2.Decision.keys())
    assert {f"DECISION_{d.name}" for d in Decision} <= wire
    assert all(d.value == d.name.lower() for d in Decision)


@pytest.mark.parametrize(
    ("decision", "reusable", "cached", "pulled"),
    [
        (Decision.PULL, 4096, 0, 4096),
        (Decision.PULL, 4096, 1024, 3072),
        (Decision.PULL_PREFIX, 2048, 512, 1536),
        # P's own cache already holds more than the handle offers: nothing moves, never a negative count.
        (Decision.PULL, 1024, 4096, 0),
        # A recompute moves nothing, whatever the handle would have offered.
        (Decision.RECOMPUTE_COST, 4096, 0, 0),
        (Decision.RECOMPUTE_CONTENDED, 4096, 1024, 0),
    ],
)
def test_a_pull_moves_what_the_handle_shares_beyond_ps_own_cache(
    decision: Decision, reusable: int, cached: int, pulled: int
) -> None:
    verdict = PullVerdict(decision, "why", reusable_tokens=reusable, cached_tokens=cached)
    assert verdict.pulled_tokens == pulled


def test_a_plan_reads_its_decision_from_its_verdict() -> None:
    verdict = PullVerdict(Decision.RECOMPUTE_NO_HANDLE, "no handle")
    plan = RoutePlan(mk_node("p0"), mk_node("d0"), verdict)
    assert plan.decision is Decision.RECOMPUTE_NO_HANDLE and plan.verdict.reason == "no handle"
    assert verdict.transfer_ms == verdict.recompute_ms == 0.0 and verdict.life_left_ms == 0


def test_no_eligible_nodes_is_an_error_of_its_own() -> None:
    assert issubclass(NoEligibleNodes, Exception) and not issubclass(NoEligibleNodes, ValueError)
