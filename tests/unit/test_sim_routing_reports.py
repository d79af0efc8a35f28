"""Routing hears of a turn when it is over, as the gateway reports it after D's last token."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, simulator_for
from kvplane.bench.sim.routers import PolicyRouter
from kvplane.bench.workloads.turns import Turn

COSTS = SimCosts()
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))


def test_the_report_reaches_routing_when_the_turns_answer_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    heard: list[tuple[str, float]] = []
    original = PolicyRouter.observe

    def spy(self: PolicyRouter, turn: Turn, choice: Any, outcome: Any) -> None:
        heard.append((turn.conversation, sim._now))
        original(self, turn, choice, outcome)

    monkeypatch.setattr(PolicyRouter, "observe", spy)
    turns = [Turn(0.0, "a", 0, 3_000, 400), Turn(0.5, "b", 0, 2_000, 10)]
    sim = simulator_for(BASELINES["kvplane"], CONFIG)
    result = sim.run(turns)
    ttft = dict(zip(result.prompt_tokens, result.ttft_s, strict=True))
    # When D took each turn: its first token came a step later.
    starts = {
        "a": turns[0].arrival_s + ttft[3_000] - COSTS.decode_step_s(1),
        "b": turns[1].arrival_s + ttft[2_000] - COSTS.decode_step_s(2),
    }
    # Each turn's end: its start plus its decode (the two overlap on D for a while).
    assert heard[0][0] == "b" and heard[1][0] == "a"
    assert dict(heard)["a"] > starts["a"] + COSTS.decode_s(390, 2)
    assert dict(heard)["b"] == pytest.approx(starts["b"] + COSTS.decode_s(10, 2))


def test_what_p_caches_reaches_routing_only_through_ps_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """P registers its KV pool; its prefix cache is off, which routing learns from P's report."""
    believed: list[int] = []
    original = PolicyRouter.route

    def spy(self: PolicyRouter, turn: Turn, conversation: Any, prompt: Any, now: float) -> Any:
        record = self.router.prefill_record.cached_tokens(("default", "a"), turn.prompt_tokens, prompt, 16)
        believed.append(record.get("p0", 0))
        return original(self, turn, conversation, prompt, now)

    monkeypatch.setattr(PolicyRouter, "route", spy)
    no_cache = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1, prefill_cache_bytes=0))
    turns = [
        Turn(0.0, "a", 0, 2_000, 10),
        Turn(20.0, "a", 1, 2_400, 10, reused_prefix_tokens=2_010, previous_context_tokens=2_010),
        Turn(40.0, "a", 2, 2_800, 10, reused_prefix_tokens=2_410, previous_context_tokens=2_410),
    ]
    result = simulator_for(BASELINES["kvplane"], no_cache).run(turns)
    assert result.summary.cached_tokens == 0
    # Turn 1 was routed believing P held the first prompt; P's report of it said otherwise.
    assert believed == [0, 2_000, 0]


def test_a_busy_ps_report_counts_what_its_prompt_has_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the sim-engine reports it: P's load at a report tick counts the prompt it is computing for
    the tokens it has not computed yet then, not for all of them, nor for none."""
    seen: list[Any] = []
    original = PolicyRouter.route

    def spy(self: PolicyRouter, turn: Turn, conversation: Any, prompt: Any, now: float) -> Any:
        seen.append((now, self.fleet.node_state(0, now).load))
        return original(self, turn, conversation, prompt, now)

    monkeypatch.setattr(PolicyRouter, "route", spy)
    baseline = BASELINES["kvplane"]
    # 24,000 tokens compute for about 0.8 s; the second turn arrives after the tick at 0.5 s.
    turns = [Turn(0.0, "a", 0, 24_000, 10), Turn(0.6, "b", 0, 1_000, 10)]
    simulator_for(baseline, CONFIG).run(turns)
    now, load = seen[1]
    assert now == 0.6 and load.running_requests == 1
    start = baseline.control_path_s or 0.0
    end = start + COSTS.prefill_s(24_000)
    assert start < 0.5 < end
    assert load.queued_prefill_tokens == round(24_000 * (end - 0.5) / (end - start))


def test_routing_hears_the_p_leg_as_the_gateway_times_it_and_ps_own_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The P leg's time is P's wait, pull and compute, as the gateway times it; beside it, the wait
    as P measures it (kvplane_queued_ms), for routing to take off."""
    heard: dict[str, Any] = {}
    original = PolicyRouter.observe

    def spy(self: PolicyRouter, turn: Turn, choice: Any, outcome: Any) -> None:
        heard[turn.conversation] = outcome
        original(self, turn, choice, outcome)

    monkeypatch.setattr(PolicyRouter, "observe", spy)
    # Two turns at once on one P: the second waits for the first's prefill.
    turns = [Turn(0.0, "a", 0, 12_000, 10), Turn(0.0, "b", 0, 2_000, 10)]
    simulator_for(BASELINES["kvplane"], CONFIG).run(turns)
    first, second = heard["a"], heard["b"]
    assert first.queued_s == pytest.approx(0.0)
    assert first.prefill_s == pytest.approx(COSTS.prefill_s(12_000))
    assert second.queued_s == pytest.approx(COSTS.prefill_s(12_000))
    assert second.prefill_s == pytest.approx(COSTS.prefill_s(12_000) + COSTS.prefill_s(2_000))
