"""Closed loop: a conversation's next turn is sent only once the answer before it is done."""

from __future__ import annotations

import dataclasses

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, simulator_for
from kvplane.bench.workloads.turns import Turn

COSTS = SimCosts()
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1, prefill_cache_bytes=0))
TURNS = [
    Turn(0.0, "a", 0, 2_000, 100),
    # Due before the first answer is done (its prefill alone takes 0.16 s).
    Turn(0.1, "a", 1, 3_000, 10, reused_prefix_tokens=2_100, previous_context_tokens=2_100),
]


def test_a_turn_due_before_the_previous_answer_is_sent_when_it_is_done() -> None:
    config = dataclasses.replace(CONFIG, closed_loop=True)
    result = simulator_for(BASELINES["no-reuse"], config).run(TURNS)
    assert result.summary.turns == 2
    # Sent at the first turn's end, to an idle P: its TTFT is its own prefill and D's first step.
    assert result.ttft_s[1] == pytest.approx(COSTS.prefill_s(3_000) + COSTS.decode_step_s(1))


def test_open_loop_turns_arrive_when_the_workload_says() -> None:
    result = simulator_for(BASELINES["no-reuse"], CONFIG).run(TURNS)
    first_done = COSTS.prefill_s(2_000)
    # D's first step: the first turn is still decoding beside it.
    step = COSTS.decode_step_s(2)
    assert result.ttft_s[1] == pytest.approx(first_done + COSTS.prefill_s(3_000) - 0.1 + step)


def test_a_held_turn_is_sent_after_the_clients_pause() -> None:
    config = dataclasses.replace(CONFIG, closed_loop=True, think_s=0.5)
    result = simulator_for(BASELINES["no-reuse"], config).run(TURNS)
    # Sent 0.5 s after the first answer, to an idle P: its TTFT counts from then, as the client's does.
    assert result.ttft_s[1] == pytest.approx(COSTS.prefill_s(3_000) + COSTS.decode_step_s(1))
    without = simulator_for(BASELINES["no-reuse"], dataclasses.replace(config, think_s=0.0)).run(TURNS)
    assert result.summary.simulated_s >= without.summary.simulated_s + 0.5 - 1e-9


def test_a_turn_that_comes_during_the_pause_waits_its_place() -> None:
    config = dataclasses.replace(CONFIG, closed_loop=True, think_s=5.0)
    first_done = COSTS.prefill_s(2_000) + COSTS.decode_s(100, 1)
    # Turn 2 is due in turn 1's pause: it is held behind turn 1, not sent ahead of it.
    turns = [
        *TURNS,
        Turn(first_done + 1.0, "a", 2, 3_500, 10, reused_prefix_tokens=3_010, previous_context_tokens=3_010),
    ]
    result = simulator_for(BASELINES["no-reuse"], config).run(turns)
    assert list(result.prompt_tokens) == [2_000, 3_000, 3_500]


def test_a_negative_pause_is_refused() -> None:
    with pytest.raises(ValueError, match="think_s"):
        dataclasses.replace(CONFIG, closed_loop=True, think_s=-1.0)


# One turn at a time on one P and one D: each answer's decode time is its own.
APART = [Turn(10.0 * i, f"c{i}", 0, 2_000, 100) for i in range(40)]


def _tpots(config: SimConfig) -> tuple[float, float]:
    summary = simulator_for(BASELINES["no-reuse"], config).run(APART).summary
    return summary.tpot_p50_ms, summary.tpot_p99_ms


def test_answers_take_the_modelled_time_unless_a_spread_is_set() -> None:
    modelled = COSTS.decode_step_s(1) * 1000
    assert _tpots(CONFIG) == pytest.approx((modelled, modelled))
    spread = dataclasses.replace(CONFIG, decode_spread=0.02, decode_spread_seed=7)
    p50, p99 = _tpots(spread)
    # Varied, within three standard deviations, and the same draws for the same seed.
    assert p99 > modelled * 1.01
    assert modelled * 0.94 <= p50 <= p99 <= modelled * 1.06
    assert _tpots(spread) == (p50, p99)
    assert _tpots(dataclasses.replace(spread, decode_spread_seed=8)) != (p50, p99)


def test_a_spread_outside_its_range_is_refused() -> None:
    for bad in (-0.01, 0.34):
        with pytest.raises(ValueError, match="decode_spread"):
            dataclasses.replace(CONFIG, decode_spread=bad)
