"""The simulator's side of the check against the live stack.

A live benchmark replays a small workload through the gateway on sim-engines
and reports its decision mix and reused token fraction; `profile` gives the
simulator's for the same turns and fleet, and `agree` compares the two
within a tolerance (absolute, on shares in [0, 1]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvplane.bench.sim.baselines import BASELINES, RunOptions, simulator_for
from kvplane.bench.sim.engine import SimConfig
from kvplane.bench.workloads.turns import Turn


@dataclass(frozen=True, slots=True)
class Profile:
    """Share of turns per decision, and share of prompt tokens pulled rather than computed."""

    decision_shares: Mapping[str, float]
    reused_fraction: float


def profile(turns: Iterable[Turn], config: SimConfig, policy: str = "kvplane", seed: int = 0) -> Profile:
    summary = simulator_for(BASELINES[policy], config, RunOptions(seed=seed)).run(turns, policy).summary
    total = max(1, summary.turns)
    return Profile({k: v / total for k, v in summary.decisions.items()}, summary.reused_fraction)


def agree(sim: Profile, live: Profile, tolerance: float = 0.05) -> list[str]:
    """Where the two differ by more than `tolerance`; empty when they agree."""
    out = []
    for decision in sorted(set(sim.decision_shares) | set(live.decision_shares)):
        a = sim.decision_shares.get(decision, 0.0)
        b = live.decision_shares.get(decision, 0.0)
        if abs(a - b) > tolerance:
            out.append(f"{decision}: simulated {a:.3f}, live {b:.3f}")
    if abs(sim.reused_fraction - live.reused_fraction) > tolerance:
        out.append(f"reused fraction: simulated {sim.reused_fraction:.3f}, live {live.reused_fraction:.3f}")
    return out
