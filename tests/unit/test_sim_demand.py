"""In the simulator, turns waiting on a full decode node are answered by the coordinator's demand policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench.demand_bench import Round, figures
from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.sim.baselines import Baseline
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.engine import Simulator
from kvplane.bench.sim.retention import (
    DEFAULT_DEMAND_LATENCY_S,
    DEMAND_LATENCY_SOURCE,
    MEASURED_DEMAND_LATENCY_S,
)
from kvplane.bench.workloads import AgenticWorkload, Turn, agentic_turns
from kvplane.connector.node_agent.settings import DEFAULT_DEMAND_REFRESH_S
from kvplane.services.eviction.policy import RetentionPipeline

REPO = Path(__file__).resolve().parents[2]
# Decode nodes too small for the workload's retained KV: turns wait for memory (vLLM's pinned KV).
CONFIG = SimConfig(
    cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=8 << 30), pressure="wait"
)


def _turns() -> list[Turn]:
    return list(agentic_turns(AgenticWorkload(seed=9, sessions_per_s=0.2, duration_s=600.0)))


def test_waiting_turns_are_answered_by_the_pipelines_demand_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    original = RetentionPipeline.for_demand

    def spy(self: RetentionPipeline, snapshot: Any, node_id: str) -> Any:
        calls.append(node_id)
        return original(self, snapshot, node_id)

    monkeypatch.setattr(RetentionPipeline, "for_demand", spy)
    summary = simulator_for(BASELINES["kvplane"], CONFIG).run(_turns()).summary
    assert calls, "some turns waited, and the demand policy was asked"
    assert summary.releases.get("demand", 0) > 0


def test_the_answer_comes_one_control_plane_latency_after_the_turn_starts_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    signals: list[tuple[int, float]] = []
    answers: list[tuple[int, float]] = []
    signal, answer = Simulator._signal_demand, Simulator._answer_demand

    def on_signal(self: Simulator, d: Any, now: float) -> None:
        due = d.index in self._demand_due
        signal(self, d, now)
        if not due and d.index in self._demand_due:
            signals.append((d.index, now))

    def on_answer(self: Simulator, d: Any, now: float) -> None:
        answers.append((d.index, now))
        answer(self, d, now)

    monkeypatch.setattr(Simulator, "_signal_demand", on_signal)
    monkeypatch.setattr(Simulator, "_answer_demand", on_answer)
    simulator_for(BASELINES["kvplane"], CONFIG).run(_turns())
    assert answers
    # Every answer is one control-plane latency after its node's signal, or a repeat: the
    # node's agent repeats a demand that lasts, DEFAULT_DEMAND_REFRESH_S after the answer before.
    due: dict[int, float] = {}
    events = sorted([(t, 0, i) for i, t in signals] + [(t, 1, i) for i, t in answers])
    for t, kind, node in events:
        if kind == 0:
            due[node] = t + DEFAULT_DEMAND_LATENCY_S
        else:
            assert node in due and abs(due[node] - t) < 1e-9
            due[node] = t + DEFAULT_DEMAND_REFRESH_S


def test_a_demand_that_lasts_is_repeated_and_releases_what_ended_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D holds a's and b's running turns; c's turn needs more than is left. The first answer
    # finds nothing to release (a and b still run). b's turn then ends, and its KV stays on D as
    # b's handle: nothing is freed, so only a repeated demand has it released for c, as the node
    # agent repeats a demand that lasts. Without the repeat, c waits for a periodic release.
    costs = SimCosts()
    cluster = ClusterSpec(prefill_nodes=1, decode_nodes=1, decode_kv_capacity_bytes=costs.kv_bytes(13_500))
    turns = [Turn(0.0, "a", 0, 4000, 2000), Turn(0.1, "b", 0, 4000, 200), Turn(1.0, "c", 0, 6000, 10)]
    ended: dict[str, float] = {}
    started: dict[str, float] = {}
    finish, start = Simulator._finish, Simulator._start

    def on_finish(self: Simulator, now: float, flight: Any) -> None:
        finish(self, now, flight)
        if flight.decode.stalled_s == flight.stalled_s:
            ended.setdefault(flight.turn.conversation, now)

    def on_start(self: Simulator, flight: Any, now: float) -> None:
        started[flight.turn.conversation] = now
        start(self, flight, now)

    monkeypatch.setattr(Simulator, "_finish", on_finish)
    monkeypatch.setattr(Simulator, "_start", on_start)
    summary = simulator_for(BASELINES["kvplane"], SimConfig(cluster=cluster, costs=costs)).run(turns).summary
    assert summary.waited_turns == 1
    assert started["c"] > ended["b"], "c waited for b's blocks"
    assert started["c"] - ended["b"] <= DEFAULT_DEMAND_REFRESH_S + 1e-9
    assert summary.releases.get("demand") == 1


def test_a_pipeline_without_the_demand_plugin_leaves_waiting_turns_to_the_engine() -> None:
    ttl_only = Baseline(
        "ttl", "policy", {"policies": [{"name": "max_age", "engine_ttl_s": 480, "margin_s": 30}]}, 480.0
    )
    summary = simulator_for(ttl_only, CONFIG).run(_turns()).summary
    assert summary.waited_turns > 0
    assert "demand" not in summary.releases


def test_the_default_demand_latency_is_the_benchmarks_measured_p50() -> None:
    measured = json.loads((REPO / DEMAND_LATENCY_SOURCE).read_text(encoding="utf-8"))
    assert measured["command"].startswith("python -m kvplane.bench.demand_bench")
    assert measured["speedup"] == 1
    assert DEFAULT_DEMAND_LATENCY_S == MEASURED_DEMAND_LATENCY_S
    assert pytest.approx(measured["wait_ms"]["p50"] / 1000.0) == MEASURED_DEMAND_LATENCY_S


def test_the_bench_writes_its_figures_in_ms() -> None:
    rounds = [Round(0.110, 0.100), Round(0.120, 0.100), Round(0.105, 0.100)]
    data = figures(rounds, 64, 1.0, "python -m kvplane.bench.demand_bench --rounds 3")
    assert data["rounds"] == 3 and data["speedup"] == 1.0
    assert data["wait_ms"] == {"p50": 10.0, "p90": 20.0, "max": 20.0}
