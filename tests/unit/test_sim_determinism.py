"""A simulation is a function of its workload, seed and configuration."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, RunOptions, SimConfig, simulator_for
from kvplane.bench.sim.command import SimSpec, run_policy
from kvplane.bench.workloads import DEFAULT_TRACE, AgenticWorkload, agentic_turns, mooncake_turns

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


needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="shared Mooncake trace not present")


def _trace_ttfts(policy: str, seed: int) -> list[float]:
    spec = SimSpec(trace=str(DEFAULT_TRACE), prefill=2, decode=2, seed=seed, max_turns=300)
    return list(run_policy(spec, policy).ttft_s)


@needs_trace
@pytest.mark.parametrize("policy", ["no-reuse", "vllm-proxy", "prefix-affinity", "kvplane"])
def test_a_trace_run_depends_on_its_seed(policy: str) -> None:
    runs = {seed: _trace_ttfts(policy, seed) for seed in (1, 2, 3)}
    assert runs[1] == _trace_ttfts(policy, 1)
    assert runs[1] != runs[2] and runs[2] != runs[3] and runs[1] != runs[3]


def test_a_seed_places_each_request_within_its_millisecond(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 5, "input_length": 100, "output_length": 5, "hash_ids": [0, i]} for i in (1, 2, 3)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    plain = mooncake_turns(trace)
    assert [t.arrival_s for t in plain] == [0.005] * 3
    orders = set()
    for seed in range(8):
        turns = mooncake_turns(trace, seed=seed)
        assert all(0.005 <= t.arrival_s < 0.006 for t in turns)
        assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)
        orders.add(tuple(t.conversation for t in turns))
    assert len(orders) > 1
