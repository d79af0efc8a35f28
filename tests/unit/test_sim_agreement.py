"""The simulator's profile of a small workload, for comparison with a live replay."""

from __future__ import annotations

from kvplane.bench.sim import ClusterSpec, SimConfig
from kvplane.bench.sim.agreement import Profile, agree, profile
from kvplane.bench.workloads import AgenticWorkload, agentic_turns


def test_a_profile_has_shares_that_sum_to_one() -> None:
    turns = list(agentic_turns(AgenticWorkload(seed=4, sessions_per_s=0.1, duration_s=300.0)))
    p = profile(turns, SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1)))
    assert abs(sum(p.decision_shares.values()) - 1.0) < 1e-9
    assert 0.0 < p.pulled_fraction < 1.0
    assert agree(p, p) == []


def test_disagreement_names_the_decision_and_both_shares() -> None:
    sim = Profile({"pull": 0.6, "recompute_no_handle": 0.4}, 0.5)
    live = Profile({"pull": 0.5, "recompute_no_handle": 0.5}, 0.52)
    assert agree(sim, live, tolerance=0.05) == [
        "pull: simulated 0.600, live 0.500",
        "recompute_no_handle: simulated 0.400, live 0.500",
    ]


def test_prefix_cache_shares_are_compared_when_both_sides_measured_them() -> None:
    sim = Profile({"pull": 1.0}, 0.1, 0.5)
    assert agree(sim, Profile({"pull": 1.0}, 0.1, 0.3)) == [
        "prefix-cache fraction: simulated 0.500, live 0.300"
    ]
    assert agree(sim, Profile({"pull": 1.0}, 0.1)) == []
