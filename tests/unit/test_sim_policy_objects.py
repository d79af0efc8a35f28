"""The simulator runs the services' policy objects, not a copy of them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.sim.baselines import Baseline
from kvplane.bench.workloads import AgenticWorkload, Turn, agentic_turns
from kvplane.services.eviction.policy import RetentionPipeline
from kvplane.services.routing.policy import RoutingPolicy

CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=40 << 30))


def _turns() -> list[Turn]:
    return list(agentic_turns(AgenticWorkload(seed=9, sessions_per_s=0.2, duration_s=600.0)))


def test_every_turn_is_routed_by_routing_policy_route(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = RoutingPolicy.route

    def spy(self: RoutingPolicy, snapshot: Any, costs: Any = None) -> Any:
        calls.append(snapshot.conversation)
        return original(self, snapshot, costs)

    monkeypatch.setattr(RoutingPolicy, "route", spy)
    turns = _turns()
    simulator_for(BASELINES["kvplane"], CONFIG).run(turns)
    assert calls == [t.conversation for t in turns]


def test_retention_is_decided_by_retention_pipeline_evaluate(monkeypatch: pytest.MonkeyPatch) -> None:
    evaluations = []
    original = RetentionPipeline.evaluate

    def spy(self: RetentionPipeline, snapshot: Any) -> Any:
        evaluations.append(snapshot.now_unix_ms)
        return original(self, snapshot)

    monkeypatch.setattr(RetentionPipeline, "evaluate", spy)
    simulator_for(BASELINES["kvplane"], CONFIG).run(_turns())
    assert len(evaluations) > 100


def test_a_routing_policy_file_swapped_in_changes_the_decision_mix(tmp_path: Path) -> None:
    default = simulator_for(BASELINES["kvplane"], CONFIG).run(_turns()).summary
    packaged = resources.files("kvplane.services.routing.policy").joinpath("default_policy.yaml").read_text()
    never_pull = tmp_path / "never_pull.yaml"
    never_pull.write_text(packaged.replace("threshold_tokens: 64", "threshold_tokens: 100000000"))
    baseline = Baseline(
        "strict", "policy", BASELINES["kvplane"].retention, 480.0, routing_policy=str(never_pull)
    )
    strict = simulator_for(baseline, CONFIG).run(_turns()).summary
    assert default.decisions.get("pull", 0) > 0
    assert strict.decisions.get("pull", 0) == 0
    assert strict.decisions.get("recompute_below_threshold", 0) > 0
    assert strict.pulled_tokens == 0


def test_a_retention_policy_swapped_by_name_changes_the_release_reasons() -> None:
    ttl = Baseline(
        "ttl", "policy", {"policies": [{"name": "max_age", "engine_ttl_s": 480, "margin_s": 30}]}, 480.0
    )
    ttl_only = simulator_for(ttl, CONFIG).run(_turns()).summary
    budget = Baseline(
        "tight",
        "policy",
        {"policies": [{"name": "node_budget", "high_bytes": 4 << 30, "low_bytes": 2 << 30}]},
        480.0,
    )
    tight = simulator_for(budget, CONFIG).run(_turns()).summary
    assert "node_budget" not in ttl_only.releases and ttl_only.releases.get("max_age", 0) > 0
    assert tight.releases.get("node_budget", 0) > 0 and "max_age" not in tight.releases
