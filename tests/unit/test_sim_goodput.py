"""Capacity at an SLO: the highest load factor at which a policy's TTFT p99 (and, if asked, its TPOT
p99) stays within a bound."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvplane.bench.sim.command import SimSpec, main
from kvplane.bench.sim.goodput import Goodput, Tails, find_goodput, offered_turns_per_s, tails_at


def p99_at(spec: SimSpec, name: str, factor: float) -> float:
    return tails_at(spec, name, factor).ttft_p99_ms


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
    # The reported p99s are the runs' own, TPOT's too.
    assert tails_at(SPEC, "no-reuse", g.met) == Tails(g.met_p99_ms, g.met_tpot_p99_ms)
    assert not math.isnan(g.met_tpot_p99_ms)
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
    def tails(spec: SimSpec, name: str, factor: float) -> Tails:
        return Tails(500.0 if 1.0 <= factor <= 3.0 else 5000.0, 30.0)

    monkeypatch.setattr("kvplane.bench.sim.goodput.tails_at", tails)
    g = find_goodput(SPEC, "no-reuse", 1000.0)
    assert 2.0 <= g.met <= 3.0 < g.missed <= 4.0 and g.missed / g.met <= 1.05


def test_a_tpot_slo_bounds_the_capacity_where_ttft_alone_would_not(monkeypatch: pytest.MonkeyPatch) -> None:
    # TTFT always within its SLO; TPOT p99 grows with the load and crosses 50 ms at 2.5x, between
    # two of the search's doublings (2x and 4x), so that the bisection has to find it.
    def tails(spec: SimSpec, name: str, factor: float) -> Tails:
        return Tails(500.0, 20.0 * factor)

    monkeypatch.setattr("kvplane.bench.sim.goodput.tails_at", tails)
    ttft_only = find_goodput(SPEC, "no-reuse", 1000.0)
    assert ttft_only.met == 8.0 and ttft_only.met_tpot_p99_ms == 160.0
    joint = find_goodput(SPEC, "no-reuse", 1000.0, slo_tpot_p99_ms=50.0)
    assert 2.0 < joint.met <= 2.5 < joint.missed and joint.missed / joint.met <= 1.05
    # The TPOTs reported are the stubbed runs' at those very loads.
    assert joint.met_tpot_p99_ms == 20.0 * joint.met and joint.missed_tpot_p99_ms == 20.0 * joint.missed
    assert joint.slo_tpot_p99_ms == 50.0 and joint.as_json()["capacity_tpot_p99_ms"] == joint.met_tpot_p99_ms
    # Either bound missed is a miss: a TTFT over its SLO fails the load whatever its TPOT.
    monkeypatch.setattr("kvplane.bench.sim.goodput.tails_at", lambda s, n, f: Tails(5000.0, 1.0))
    assert find_goodput(SPEC, "no-reuse", 1000.0, slo_tpot_p99_ms=50.0).met == 0.0


def test_a_tpot_slo_on_a_real_run_lowers_the_capacity_to_where_tpot_holds() -> None:
    # conditional-disagg prefills on D under load, stalling D's answers: its TPOT p99 grows with it.
    low, high = tails_at(SPEC, "conditional-disagg", 0.25), tails_at(SPEC, "conditional-disagg", 8.0)
    assert low.tpot_p99_ms < high.tpot_p99_ms
    tpot_slo = (low.tpot_p99_ms + high.tpot_p99_ms) / 2
    joint = find_goodput(SPEC, "conditional-disagg", 1e12, slo_tpot_p99_ms=tpot_slo)
    assert 0.25 <= joint.met < joint.missed <= 8.0
    assert joint.met_tpot_p99_ms <= tpot_slo < joint.missed_tpot_p99_ms
    assert find_goodput(SPEC, "conditional-disagg", 1e12).met == 8.0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        find_goodput(SPEC, "no-reuse", 2000.0, low=2.0, high=1.0)
    with pytest.raises(ValueError):
        find_goodput(SPEC, "no-reuse", 0.0)
    with pytest.raises(ValueError):
        find_goodput(SPEC, "no-reuse", 2000.0, slo_tpot_p99_ms=0.0)


def test_the_command_prints_each_policys_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    spec_args = ["--workload", "agentic", "--prefill", "2", "--decode", "2", "--seed", "3"]
    # The command runs the whole workload; keep it to the policies that run fast.
    assert main([*spec_args, "--policies", "no-reuse", "--goodput", "--slo-p99-ms", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "capacity at TTFT p99 <= 1e+09 ms" in out
    assert "no-reuse" in out and ">= 8" in out
    assert "TPOT p99 ms there" in out
    assert main([*spec_args, "--policies", "no-reuse", "--goodput", "--slo-tpot-p99-ms", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "capacity at TTFT p99 <= 2000 ms and TPOT p99 <= 1e+09 ms" in out
    # Under a TPOT bound the step above may have missed on TPOT: its TPOT is shown as well.
    assert "TPOT p99 ms one step more" in out


def test_a_tpot_slo_without_goodput_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "agentic", "--slo-tpot-p99-ms", "30"])
    assert exc.value.code == 2
    assert "--slo-tpot-p99-ms needs --goodput" in capsys.readouterr().err


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
        return Goodput(name, slo_p99_ms, 2.0, 1500.0, 2.1, 2100.0, 1.5, None, 27.25)

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
    assert "| kvplane | 2.00 | 3.0 | 1,500 | 2,100 | 27.2 |" in lines
