"""`kvplane sim` says when the fleet cannot keep up with the turns, and can slow their arrivals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.bench.sim.command import (
    SimSpec,
    build_parser,
    decode_memory_load,
    overload_warning,
    prefill_load,
)
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.workloads import Turn


def _turns(n: int, every_s: float, prompt: int = 4000, output: int = 200) -> list[Turn]:
    return [Turn(i * every_s, f"c{i}", 0, prompt, output) for i in range(n)]


def test_prefill_load_is_the_work_offered_over_what_the_nodes_can_do() -> None:
    costs = SimCosts()
    turns = _turns(101, every_s=1.0)
    expected = 101 * costs.prefill_s(4000) / (100.0 * 2)
    assert prefill_load(turns, 2, costs) == pytest.approx(expected)
    slowed = [replace(t, arrival_s=t.arrival_s * 4) for t in turns]
    assert prefill_load(slowed, 2, costs) == pytest.approx(expected / 4)


def test_a_fleet_too_small_for_the_prefill_work_is_warned_of_with_the_scale_that_fits() -> None:
    costs = SimCosts()
    every = costs.prefill_s(4000) / 3  # three prompts' work arrives per prompt's time
    spec = SimSpec(prefill=1, decode=64)
    warning = overload_warning(_turns(200, every), spec)
    assert warning is not None and "3.0x the prefill work 1 P" in warning and "--time-scale 3.0" in warning
    assert overload_warning(_turns(200, every), replace(spec, prefill=4)) is None


def test_decode_memory_overload_is_warned_of_first() -> None:
    spec = SimSpec(prefill=64, decode=1, kv_gib_per_decode=0.5)
    turns = _turns(500, every_s=0.05, prompt=8000, output=500)
    assert decode_memory_load(turns, spec) > 1
    warning = overload_warning(turns, spec)
    assert warning is not None and "KV memory of 1 D (0.5 GiB each)" in warning


def test_time_scale_is_a_positive_flag() -> None:
    args = build_parser().parse_args(["--workload", "agentic", "--time-scale", "2.5"])
    assert args.time_scale == 2.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--workload", "agentic", "--time-scale", "0"])
