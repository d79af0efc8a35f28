"""Baselines through the simulator: sanity bounds that hold whatever the calibration."""

from __future__ import annotations

from functools import cache

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimSummary, simulator_for
from kvplane.bench.workloads import AgenticWorkload, Turn, agentic_turns

CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=40 << 30))


@cache
def _turns() -> tuple[Turn, ...]:
    # Strip reasoning often, so that prefixes diverge from handles.
    spec = AgenticWorkload(seed=2, sessions_per_s=0.2, duration_s=900.0, strip_reasoning_probability=0.2)
    return tuple(agentic_turns(spec))


@cache
def _run(name: str) -> SimSummary:
    return simulator_for(BASELINES[name], CONFIG).run(_turns(), name).summary


def test_no_reuse_reuses_and_retains_nothing() -> None:
    s = _run("no-reuse")
    assert s.reused_tokens == 0 and s.retained_gb_s == 0.0
    assert s.decisions == {"recompute_disabled": len(_turns())}


@pytest.mark.parametrize("name", ["vllm-proxy", "kvplane-ttl", "kvplane", "kvplane-long-ttl"])
def test_the_unlimited_memory_oracle_bounds_every_policy(name: str) -> None:
    oracle = _run("oracle")
    s = _run(name)
    assert 0 < s.reused_tokens <= oracle.reused_tokens <= oracle.reusable_tokens
    assert s.turns == oracle.turns == len(_turns())


def test_reuse_cuts_ttft_when_memory_suffices() -> None:
    assert _run("oracle").ttft_p50_ms < _run("no-reuse").ttft_p50_ms


def test_only_the_unchecked_proxy_imports_wrong_prefixes() -> None:
    assert _run("vllm-proxy").wrong_prefix_tokens > 0
    for name in ("kvplane-ttl", "kvplane", "oracle"):
        assert _run(name).wrong_prefix_tokens == 0
    assert _run("kvplane").decisions.get("recompute_prefix_mismatch", 0) > 0


def test_kvplane_releases_with_its_policies_reasons() -> None:
    assert set(_run("kvplane-ttl").releases) <= {"max_age", "superseded", "engine_pressure", "engine_ttl"}
    assert "engine_ttl" not in _run("kvplane").releases  # max_age releases 30 s before D's TTL
    assert "superseded" not in _run("vllm-proxy").releases  # nothing releases for the proxy


PINNED = SimConfig(
    cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=12 << 30), pressure="wait"
)


@cache
def _pinned(name: str) -> SimSummary:
    return simulator_for(BASELINES[name], PINNED).run(_turns(), name).summary


def test_pinned_kv_makes_turns_wait_instead_of_evicting() -> None:
    proxy = _pinned("vllm-proxy")
    assert proxy.waited_turns > 0 and "engine_pressure" not in proxy.releases
    assert proxy.turns == len(_turns())
    assert _run("vllm-proxy").waited_turns == 0


def test_early_release_shortens_waits_for_pinned_kv() -> None:
    assert _pinned("kvplane").waited_turns < _pinned("vllm-proxy").waited_turns
    assert _pinned("kvplane").ttft_p90_ms < _pinned("vllm-proxy").ttft_p90_ms
