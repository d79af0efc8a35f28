"""Capacity at an SLO: the highest offered load at which a policy keeps TTFT p99 within a bound.

Optionally TPOT p99 too (`slo_tpot_p99_ms`): goodput as DistServe defines it holds a request to
both its first-token and its per-token bound, and a policy that buys first tokens by stalling
the answers already streaming on a decode node (a prefill there holds up every decode in its
step) spends TPOT to do so. Either way the TPOT p99 at the capacity found is reported beside it.

The offered load is the workload's own arrival rate times a factor: the same turns, their
arrival times divided by it (`SimSpec.time_scale` is its inverse). Every doubling of the factor
from `low` to `high` is run first, and the highest that met the SLO is kept: p99 need not fall
with load everywhere (spreading an agentic workload out can cost a policy its cache hits), so a
miss at a low factor does not stop the search. Between that factor and the next one up, the
capacity is found by bisection over the logarithm. The answer is the highest factor tried that
met the SLO, with the next one tried above it, which did not: within `tolerance` of each other
(or at a bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvplane.bench.sim.command import SimSpec, run_policy, spec_turns


@dataclass(frozen=True, slots=True)
class Goodput:
    """A policy's capacity at the SLO: load factors relative to the workload's own rate."""

    name: str
    slo_p99_ms: float
    # The highest factor tried whose p99 met the SLO (0: not even `low` did), and its p99.
    met: float
    met_p99_ms: float
    # The lowest factor tried whose p99 missed it (inf: not even `high` did), and its p99.
    missed: float
    missed_p99_ms: float
    # Turns per second the workload offers at factor 1.
    base_turns_per_s: float
    # The TPOT p99 bound (ms) a run must meet as well; None: TTFT alone.
    slo_tpot_p99_ms: float | None = None
    # TPOT p99 (ms) at `met` and at `missed`.
    met_tpot_p99_ms: float = math.nan
    missed_tpot_p99_ms: float = math.nan

    @property
    def turns_per_s(self) -> float:
        """The offered rate at `met`: turns per second the policy served within the SLO."""
        return self.met * self.base_turns_per_s

    def capacity_text(self) -> str:
        """The capacity as a factor: "< low" when not even the lowest load met the SLO, ">= high"
        when the highest did."""
        if self.met == 0:
            return f"< {self.missed:g}"
        if math.isinf(self.missed):
            return f">= {self.met:g}"
        return f"{self.met:.2f}"

    def cells(self) -> tuple[str, str, str, str, str]:
        """Capacity, turns/s there, the TTFT p99s (ms) at it and one step above, and the TPOT
        p99 (ms) at it: a table's cells."""
        return (
            self.capacity_text(),
            f"{self.turns_per_s:,.1f}",
            "-" if math.isnan(self.met_p99_ms) else f"{self.met_p99_ms:,.0f}",
            "-" if math.isnan(self.missed_p99_ms) else f"{self.missed_p99_ms:,.0f}",
            "-" if math.isnan(self.met_tpot_p99_ms) else f"{self.met_tpot_p99_ms:.1f}",
        )

    def as_json(self) -> dict[str, object]:
        """The figures, with the unbounded ones as None (JSON has no infinity)."""
        return {
            "name": self.name,
            "slo_p99_ms": self.slo_p99_ms,
            "capacity": self.met,
            "capacity_p99_ms": None if math.isnan(self.met_p99_ms) else self.met_p99_ms,
            "missed": None if math.isinf(self.missed) else self.missed,
            "missed_p99_ms": None if math.isnan(self.missed_p99_ms) else self.missed_p99_ms,
            "turns_per_s": self.turns_per_s,
            "slo_tpot_p99_ms": self.slo_tpot_p99_ms,
            "capacity_tpot_p99_ms": None if math.isnan(self.met_tpot_p99_ms) else self.met_tpot_p99_ms,
            "missed_tpot_p99_ms": None if math.isnan(self.missed_tpot_p99_ms) else self.missed_tpot_p99_ms,
        }


# What a capacity table's columns say, in `Goodput.cells`'s order after the policy.
CAPACITY_COLUMNS = (
    "capacity (x the workload's rate)",
    "turns/s",
    "p99 ms there",
    "p99 ms one step more",
    "TPOT p99 ms there",
)


def offered_turns_per_s(spec: SimSpec) -> float:
    """Turns per second the spec's workload offers as it is (factor 1)."""
    turns = spec_turns(replace(spec, time_scale=1.0))
    if len(turns) < 2:
        return 0.0
    span = max(t.arrival_s for t in turns) - min(t.arrival_s for t in turns)
    return len(turns) / span if span > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Tails:
    """One run's p99s (ms)."""

    ttft_p99_ms: float
    tpot_p99_ms: float


def tails_at(spec: SimSpec, name: str, factor: float) -> Tails:
    """TTFT and TPOT p99 (ms) of `name` with the spec's turns offered at `factor` times their rate."""
    summary = run_policy(replace(spec, time_scale=1.0 / factor), name).summary
    return Tails(summary.ttft_p99_ms, summary.tpot_p99_ms)


def find_goodput(
    spec: SimSpec,
    name: str,
    slo_p99_ms: float = 2000.0,
    *,
    slo_tpot_p99_ms: float | None = None,
    low: float = 0.25,
    high: float = 8.0,
    tolerance: float = 0.05,
) -> Goodput:
    """`name`'s capacity on `spec` at the SLO (see the module's docstring)."""
    if not 0 < low < high or slo_p99_ms <= 0 or tolerance <= 0:
        raise ValueError("need 0 < low < high, a positive SLO and a positive tolerance")
    if slo_tpot_p99_ms is not None and slo_tpot_p99_ms <= 0:
        raise ValueError("a TPOT SLO must be positive")
    base = offered_turns_per_s(spec)

    def meets(t: Tails) -> bool:
        # A run without a TPOT (every answer one token long) has no TPOT to miss.
        tpot_ok = slo_tpot_p99_ms is None or math.isnan(t.tpot_p99_ms) or t.tpot_p99_ms <= slo_tpot_p99_ms
        return t.ttft_p99_ms <= slo_p99_ms and tpot_ok

    def goodput(met: float, at: Tails | None, missed: float, above: Tails | None) -> Goodput:
        nan = Tails(math.nan, math.nan)
        at, above = at or nan, above or nan
        return Goodput(
            name,
            slo_p99_ms,
            met,
            at.ttft_p99_ms,
            missed,
            above.ttft_p99_ms,
            base,
            slo_tpot_p99_ms,
            at.tpot_p99_ms,
            above.tpot_p99_ms,
        )

    grid = [low]
    while grid[-1] * 2 < high:
        grid.append(grid[-1] * 2)
    grid.append(high)
    runs = [(factor, tails_at(spec, name, factor)) for factor in grid]
    passed = [i for i, (_, tails) in enumerate(runs) if meets(tails)]
    if not passed:
        return goodput(0.0, None, low, runs[0][1])
    top = passed[-1]
    if top == len(runs) - 1:
        return goodput(high, runs[-1][1], math.inf, None)
    (met, met_tails), (missed, missed_tails) = runs[top], runs[top + 1]
    while missed / met > 1 + tolerance:
        mid = math.sqrt(met * missed)
        tails = tails_at(spec, name, mid)
        if meets(tails):
            met, met_tails = mid, tails
        else:
            missed, missed_tails = mid, tails
    return goodput(met, met_tails, missed, missed_tails)
