"""The front's own hop before P: kvplane's gateway sends the P leg once Route has answered."""

from __future__ import annotations

import dataclasses

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, simulator_for
from kvplane.bench.sim.baselines import MEASURED_ROUTE_S
from kvplane.bench.workloads.turns import Turn

COSTS = SimCosts()
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))


def test_a_turn_reaches_p_one_control_path_after_it_arrives() -> None:
    config = dataclasses.replace(CONFIG, control_path_s=0.05)
    result = simulator_for(BASELINES["no-reuse"], config).run([Turn(1.0, "a", 0, 2_000, 10)])
    assert result.ttft_s[0] == pytest.approx(0.05 + COSTS.prefill_s(2_000) + COSTS.decode_step_s(1))


def test_turns_behind_the_hop_queue_on_p_in_arrival_order() -> None:
    config = dataclasses.replace(CONFIG, control_path_s=0.05)
    turns = [Turn(1.0, "a", 0, 2_000, 10), Turn(1.01, "b", 0, 1_000, 10)]
    result = simulator_for(BASELINES["no-reuse"], config).run(turns)
    first_done = 1.05 + COSTS.prefill_s(2_000)
    assert list(result.ttft_s) == pytest.approx(
        [
            first_done + COSTS.decode_step_s(1) - 1.0,
            first_done + COSTS.prefill_s(1_000) + COSTS.decode_step_s(2) - 1.01,
        ]
    )


def test_kvplane_pays_its_measured_route_time() -> None:
    assert MEASURED_ROUTE_S > 0
    assert BASELINES["kvplane"].control_path_s == MEASURED_ROUTE_S
    result = simulator_for(BASELINES["kvplane"], CONFIG).run([Turn(1.0, "a", 0, 2_000, 10)])
    assert result.ttft_s[0] == pytest.approx(
        MEASURED_ROUTE_S + COSTS.prefill_s(2_000) + COSTS.decode_step_s(1)
    )


def test_a_negative_control_path_is_refused() -> None:
    with pytest.raises(ValueError, match="control_path_s"):
        SimConfig(control_path_s=-1.0)
