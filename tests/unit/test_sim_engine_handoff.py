"""The simulator as the comparison's sim-engines run a turn: a turn through P pays D's measured
hand-off before D's first step, and a turn D prefills itself costs its compute alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench.compare_fronts import KVPLANE_DECODE_PREFILL
from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, simulator_for
from kvplane.bench.sim.front_hops import HANDOFF_SOURCE, handoff_ms
from kvplane.bench.sim.ranking import SIM_ENGINE_HANDOFF_S, recorded_prefill_on_decode, sim_engine_costs
from kvplane.bench.workloads.turns import Turn
from kvplane.connector.simengine.timing_model import TimingModel

RECORD = Path(__file__).resolve().parents[2] / HANDOFF_SOURCE
PAIR = ClusterSpec(prefill_nodes=1, decode_nodes=1)


def _row(front: str, decode_ms: float | None, concurrency: int = 1) -> dict[str, Any]:
    return {"front": front, "concurrency": concurrency, "decode_engine_ttft_ms": decode_ms}


def test_the_constant_is_the_recorded_comparisons() -> None:
    document = json.loads(RECORD.read_text())
    measured = handoff_ms(document, tuple(recorded_prefill_on_decode(document["config"])))
    assert measured == pytest.approx(1000.0 * SIM_ENGINE_HANDOFF_S, abs=0.01)
    assert sim_engine_costs().handoff_fixed_s == SIM_ENGINE_HANDOFF_S
    # Machine time: a faster modelled engine does not make NIXL or HTTP faster.
    assert sim_engine_costs(speedup=4.0).handoff_fixed_s == SIM_ENGINE_HANDOFF_S


def test_the_hand_off_is_d_own_ttft_less_one_step_over_the_fronts_through_p() -> None:
    step_ms = TimingModel().decode_s(1) * 1000.0
    rows_a = [_row("kvplane", step_ms + 20.0), _row(KVPLANE_DECODE_PREFILL, 500.0), _row("x", 900.0, 8)]
    rows_b = [_row("router", step_ms + 30.0), _row("older", None)]
    document = {"workloads": {"A": {"rows": rows_a}, "B": {"rows": rows_b}}}
    # The decode-prefill front's D prefills turns itself, and 8 in flight queues: neither counts.
    assert handoff_ms(document, (KVPLANE_DECODE_PREFILL,)) == pytest.approx(25.0)
    with pytest.raises(ValueError, match="own TTFT"):
        handoff_ms({"workloads": {"A": {"rows": rows_b[1:]}}}, ())


def _turns() -> list[Turn]:
    return [Turn(1.0, "a", 0, 2_000, 10), Turn(30.0, "a", 1, 2_600, 10, 2_010, 2_010)]


def test_a_turn_through_p_reaches_d_first_step_one_hand_off_after_p_answers() -> None:
    costs = dataclasses.replace(SimCosts(), handoff_fixed_s=0.03)
    plain = simulator_for(BASELINES["no-reuse"], SimConfig(cluster=PAIR)).run(_turns()[:1])
    handed = simulator_for(BASELINES["no-reuse"], SimConfig(cluster=PAIR, costs=costs)).run(_turns()[:1])
    assert plain.ttft_s[0] == pytest.approx(SimCosts().prefill_s(2_000) + SimCosts().decode_step_s(1))
    assert handed.ttft_s[0] == pytest.approx(plain.ttft_s[0] + 0.03)


def test_the_hand_off_delays_the_answer_and_so_the_conversation_next_turn() -> None:
    costs = dataclasses.replace(SimCosts(), handoff_fixed_s=0.5)
    turns = [Turn(0.0, "a", 0, 2_000, 10), Turn(0.0, "a", 1, 2_600, 10, 2_010, 2_010)]
    plain = simulator_for(BASELINES["no-reuse"], SimConfig(cluster=PAIR, closed_loop=True)).run(turns)
    config = SimConfig(cluster=PAIR, costs=costs, closed_loop=True)
    handed = simulator_for(BASELINES["no-reuse"], config).run(turns)
    # Each turn's own TTFT pays its own hand-off; the second is sent when the first's answer is
    # done, half a second later, so the run ends a second later, not half of one.
    assert list(handed.ttft_s) == pytest.approx([t + 0.5 for t in plain.ttft_s])
    assert handed.summary.simulated_s == pytest.approx(plain.summary.simulated_s + 1.0)


def test_a_prefill_on_d_costs_its_compute_alone_where_the_engine_runs_it_so() -> None:
    chunked = SimCosts()
    alone = dataclasses.replace(SimCosts(), local_chunk_decode_step=False, handoff_fixed_s=0.03)
    turn = [Turn(0.0, "solo", 0, 600, 10)]
    stepped = simulator_for(BASELINES["conditional-disagg"], SimConfig(cluster=PAIR)).run(turn)
    compute = simulator_for(BASELINES["conditional-disagg"], SimConfig(cluster=PAIR, costs=alone)).run(turn)
    assert stepped.ttft_s[0] == pytest.approx(
        chunked.prefill_s(600) + chunked.decode_step_s(0) - chunked.handoff_s(600)
    )
    # No step, and no hand-off: D read nothing from P.
    assert compute.ttft_s[0] == pytest.approx(alone.prefill_s(600) - alone.handoff_s(600))
