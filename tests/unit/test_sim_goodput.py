"""Capacity at an SLO: the highest load factor at which a policy's TTFT p99 stays within a bound."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvplane.bench.sim.command import SimSpec, main
from kvplane.bench.sim.goodput import Goodput, find_goodput, offered_turns_per_s, p99_at

# A small fleet and a short agentic run: quick, and loaded enough that compressing it hurts.
SPEC = SimSpec(workload="agentic", prefill=2, decode=2, max_turns=600, seed=3)


def test_the_answer_brackets_the_slo_within_the_tolerance() -> None:
    # An SLO between the p99s at the bounds, so that the bisection has work to do.
    low, high = p99_at(SPEC, "no-reuse", 0.25), p99_at(SPEC, "no-reuse", 8.0)
    assert low < high
    slo = (low + high) / 2
    g = find_goodput(SPEC, "no-reuse", slo, tolerance=0.05)
    assert 0.25 <= g.met < g.missed <= 8.0
    assert g.missed / g.met <= 1.05
    assert g.met_p99_ms <= slo < g.missed_p99_ms
    # The reported p99s are the runs' own.
    assert p99_at(SPEC, "no-reuse", g.met) == g.met_p99_ms
    assert g.turns_per_s == pytest.approx(g.met * offered_turns_per_s(SPEC))


def test_an_slo_met_at_the_highest_load_or_missed_at_the_lowest_says_so() -> None:
    easy = find_goodput(SPEC, "no-reuse", 1e12)
    assert easy.met == 8.0 and math.isinf(easy.missed)
    hard = find_goodput(SPEC, "no-reuse", 1e-3)
    assert hard.met == 0.0 and hard.missed == 0.25 and hard.turns_per_s == 0.0


def test_reuse_buys_capacity() -> None:
    slo = p99_at(SPEC, "no-reuse", 1.0)
    assert find_goodput(SPEC, "kvplane", slo).met >= find_goodput(SPEC, "no-reuse", slo).met


def test_a_miss_at_a_low_load_does_not_end_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # A p99 that misses at the lowest load and meets from 1x to 3x: the capacity is near 3x.
    def p99(spec: SimSpec, name: str, factor: float) -> float:
        return 500.0 if 1.0 <= factor <= 3.0 else 5000.0

    monkeypatch.setattr("kvplane.bench.sim.goodput.p99_at", p99)
    g = find_goodput(SPEC, "no-reuse", 1000.0)
    assert 2.0 <= g.met <= 3.0 < g.missed <= 4.0 and g.missed / g.met <= 1.05


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        find_goodput(SPEC, "no-reuse", 2000.0, low=2.0, high=1.0)
    with pytest.raises(ValueError):
        find_goodput(SPEC, "no-reuse", 0.0)


def test_the_command_prints_each_policys_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    spec_args = ["--workload", "agentic", "--prefill", "2", "--decode", "2", "--seed", "3"]
    # The command runs the whole workload; keep it to the policies that run fast.
    assert main([*spec_args, "--policies", "no-reuse", "--goodput", "--slo-p99-ms", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "capacity at TTFT p99 <= 1e+09 ms" in out
    assert "no-reuse" in out and ">= 8" in out


def test_a_spec_at_another_scale_offers_its_own_rate() -> None:
    assert offered_turns_per_s(replace(SPEC, time_scale=2.0)) == offered_turns_per_s(SPEC)


def test_make_bench_searches_the_headline_tables_and_prints_a_capacity_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvplane.bench import all as bench_all

    searched: list[tuple[str, float]] = []

    def search(spec: SimSpec, name: str, slo_p99_ms: float) -> Goodput:
        # find_goodput itself is tested above: here, what make bench asks of it and prints.
        searched.append((name, slo_p99_ms))
        return Goodput(name, slo_p99_ms, 2.0, 1500.0, 2.1, 2100.0, 1.5)

    monkeypatch.setattr(bench_all, "find_goodput", search)
    key = next(iter(bench_all.GOODPUT_SLO_MS))
    specs = {key: SPEC, "other_table": SPEC}
    with ThreadPoolExecutor(max_workers=2) as pool:
        goodput = bench_all.collect_goodput(bench_all.submit_goodput(specs, pool))
    # Only the headline tables are searched, and neither the oracle, nor the unsafe proxy, nor no-reuse.
    assert list(goodput) == [key]
    names = [g.name for g in goodput[key]]
    assert "kvplane" in names and "prefix-affinity" in names and "conditional-disagg" in names
    assert not {"oracle", "vllm-proxy", "no-reuse"} & set(names)
    assert sorted(searched) == sorted((n, bench_all.GOODPUT_SLO_MS[key]) for n in names)
    lines = bench_all.capacity_table(goodput[key]).splitlines()
    assert len(lines) == 2 + len(names)
    assert "| kvplane | 2.00 | 3.0 | 1,500 | 2,100 |" in lines
