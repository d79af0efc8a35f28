"""A simulation is a function of its workload, seed and configuration."""

from __future__ import annotations

from typing import Any

from kvplane.bench.sim import BASELINES, ClusterSpec, RunOptions, SimConfig, simulator_for
from kvplane.bench.workloads import AgenticWorkload, agentic_turns

CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=4, decode_nodes=4, decode_kv_capacity_bytes=20 << 30))


def _summary(seed: int, options: RunOptions | None = None) -> dict[str, Any]:
    turns = agentic_turns(AgenticWorkload(seed=seed, sessions_per_s=0.3, duration_s=600.0))
    result = simulator_for(BASELINES["kvplane"], CONFIG, options).run(turns, "kvplane")
    out = result.summary.as_dict()
    out.pop("wall_s")
    out["ttft"] = list(result.ttft_s)
    return out


def test_the_same_seed_gives_the_same_results() -> None:
    assert _summary(1) == _summary(1)


def test_sampled_candidates_are_deterministic_for_a_seed() -> None:
    options = RunOptions(route_candidates=1, seed=5)
    assert _summary(1, options) == _summary(1, options)


def test_another_seed_gives_other_results() -> None:
    assert _summary(1)["ttft"] != _summary(2)["ttft"]
