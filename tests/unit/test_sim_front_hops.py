"""Each front's hop in the simulator is the one the recorded live comparison gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench.sim.baselines import (
    BASELINES,
    COLOCATED_ROUTE_S,
    EXAMPLE_PROXY_HOP_S,
    MEASURED_ROUTE_S,
    VLLM_ROUTER_HOP_S,
)
from kvplane.bench.sim.front_hops import COMPARE_SOURCE, front_hop_ms, ttft_excess_ms
from kvplane.bench.sim.ranking import FRONT_HOPS_S
from kvplane.connector.simengine.timing_model import TimingModel

RECORD = Path(__file__).resolve().parents[2] / COMPARE_SOURCE


def _row(front: str, p50: float, computed: int, route_ms: float | None = None) -> dict[str, Any]:
    return {
        "front": front,
        "concurrency": 1,
        "ttft_p50_ms": p50,
        "computed_tokens": computed,
        "later_turns": 10,
        "route_ms": route_ms,
    }


def test_the_constants_are_the_recorded_comparisons() -> None:
    document = json.loads(RECORD.read_text())
    assert front_hop_ms(document, "kvplane") == pytest.approx(1000.0 * MEASURED_ROUTE_S, abs=0.01)
    assert front_hop_ms(document, "kvplane-colocated") == pytest.approx(1000.0 * COLOCATED_ROUTE_S, abs=0.01)
    assert front_hop_ms(document, "vllm-router") == pytest.approx(1000.0 * VLLM_ROUTER_HOP_S, abs=0.01)
    assert front_hop_ms(document, "example-proxy") == pytest.approx(1000.0 * EXAMPLE_PROXY_HOP_S, abs=0.05)


def test_the_baselines_pay_their_fronts_hops() -> None:
    assert BASELINES["kvplane"].control_path_s == MEASURED_ROUTE_S
    assert FRONT_HOPS_S["kvplane-colocated"] == COLOCATED_ROUTE_S
    assert BASELINES["cache-aware"].control_path_s == VLLM_ROUTER_HOP_S
    assert BASELINES["vllm-proxy"].control_path_s == BASELINES["vllm-proxy-checked"].control_path_s
    assert BASELINES["vllm-proxy"].control_path_s == EXAMPLE_PROXY_HOP_S


def test_the_excess_is_over_the_closest_zero_hop_client_less_the_extra_prefill() -> None:
    rows = [
        _row("proxy", 300.0, 2_000),
        _row("zero-hop", 250.0, 1_000),
        _row("zero-hop-reuse", 240.0, 500),
    ]
    document = {"workloads": {"A": {"rows": rows}}}
    # 100 extra tokens per later turn over zero-hop's, at the timing model's prefill per token.
    extra_ms = 100 * TimingModel().prefill_per_token_s * 1000.0
    assert ttft_excess_ms(document, "proxy", "A") == pytest.approx(50.0 - extra_ms)


def test_a_hop_is_at_least_what_is_timed_and_never_negative() -> None:
    rows = [
        _row("kvplane", 240.0, 1_000, route_ms=3.0),
        _row("kvplane-colocated", 240.0, 1_000, route_ms=1.5),
        _row("router", 245.0, 1_000),
        _row("zero-hop", 250.0, 1_000),
    ]
    document = {"workloads": {"A": {"rows": rows}}}
    assert front_hop_ms(document, "kvplane") == 3.0
    # Each kvplane gateway is held to its own timed Route.
    assert front_hop_ms(document, "kvplane-colocated") == 1.5
    assert front_hop_ms(document, "router") == 0.0
