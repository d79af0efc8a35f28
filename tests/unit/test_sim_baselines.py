"""Baselines through the simulator: sanity bounds that hold whatever the calibration."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimSummary, simulator_for
from kvplane.bench.sim.engine import ENGINE_MODELS
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


def test_no_reuse_pulls_and_retains_nothing() -> None:
    s = _run("no-reuse")
    assert s.pulled_tokens == 0 and s.retained_gb_s == 0.0
    assert s.decisions == {"recompute_disabled": len(_turns())}


@pytest.mark.parametrize("name", ["vllm-proxy", "vllm-proxy-checked", "prefix-affinity", "kvplane"])
def test_the_unlimited_memory_oracle_bounds_every_policy(name: str) -> None:
    oracle = _run("oracle")
    s = _run(name)
    assert 0 < s.reused_tokens <= oracle.reused_tokens <= oracle.reusable_tokens
    assert s.turns == oracle.turns == len(_turns())


def test_reuse_cuts_ttft_when_memory_suffices() -> None:
    assert _run("oracle").ttft_p50_ms < _run("no-reuse").ttft_p50_ms


def test_only_the_unchecked_proxy_imports_wrong_prefixes() -> None:
    proxy = _run("vllm-proxy")
    assert proxy.wrong_prefix_tokens > 0 and proxy.wrong_prefix_turns > 0
    # Every wrong pull is a wrong-prefix turn, and so are later turns served from the P cache or
    # D context it poisoned.
    assert 0 < proxy.decisions["pull_wrong_prefix"] <= proxy.wrong_prefix_turns
    for name in ("no-reuse", "vllm-proxy-checked", "prefix-affinity", "kvplane", "oracle"):
        assert _run(name).wrong_prefix_tokens == 0 and _run(name).wrong_prefix_turns == 0


def test_the_checked_proxy_recomputes_where_the_unchecked_one_pulls_the_wrong_prefix() -> None:
    proxy, checked = _run("vllm-proxy"), _run("vllm-proxy-checked")
    assert checked.decisions["recompute_prefix_mismatch"] > 0 and "pull_wrong_prefix" not in checked.decisions
    assert "recompute_prefix_mismatch" not in proxy.decisions


def test_prefix_affinity_reuses_only_what_its_prefill_nodes_hold() -> None:
    s = _run("prefix-affinity")
    assert s.pulled_tokens == 0 and s.retained_gb_s == 0.0
    assert s.cached_tokens == s.reused_tokens > _run("no-reuse").cached_tokens
    assert s.decisions["prefill_cache_hit"] > 0


def test_kvplane_releases_with_its_policies_reasons() -> None:
    assert "engine_ttl" not in _run("kvplane").releases  # max_age releases 30 s before D's TTL
    assert "superseded" not in _run("vllm-proxy").releases  # nothing releases for the proxy


PINNED = SimConfig(
    cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=12 << 30), pressure="wait"
)


@cache
def _pinned(name: str) -> SimSummary:
    return simulator_for(BASELINES[name], PINNED).run(_turns(), name).summary


EVICTING = replace(PINNED, pressure="evict")


def test_pinned_is_the_default_engine_model() -> None:
    assert SimConfig().pressure == "wait" == ENGINE_MODELS["pinned"]


def test_pinned_kv_makes_turns_wait_instead_of_evicting() -> None:
    proxy = _pinned("vllm-proxy")
    assert proxy.waited_turns > 0 and "engine_pressure" not in proxy.releases
    assert proxy.turns == len(_turns())
    evicting = simulator_for(BASELINES["vllm-proxy"], EVICTING).run(_turns()).summary
    assert evicting.waited_turns == 0 and evicting.releases.get("engine_pressure", 0) > 0
