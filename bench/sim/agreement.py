"""The simulator's side of the check against the live stack.

A live benchmark replays a small workload through the gateway on sim-engines
and reports its decision mix and the share of prompt tokens P pulled from a
decode node; `profile` gives the simulator's for the same turns and fleet,
and `agree` compares the two within a tolerance (absolute, on shares in
[0, 1]). Tokens P found in its own prefix cache are not pulled, on either
side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kvplane.bench.sim.baselines import BASELINES, RunOptions, simulator_for
from kvplane.bench.sim.engine import SimConfig
from kvplane.bench.workloads.turns import Turn


@dataclass(frozen=True, slots=True)
class Profile:
    """Share of turns per decision, and shares of prompt tokens pulled from a decode node and
    found in the prefill node's own prefix cache (None: not measured)."""

    decision_shares: Mapping[str, float]
    pulled_fraction: float
    cached_fraction: float | None = None


def profile(
    turns: Iterable[Turn],
    config: SimConfig,
    policy: str = "kvplane",
    seed: int = 0,
    routing_policy: str = "",
) -> Profile:
    """The simulator's profile of `turns`; `routing_policy` names a routing policy file to run
    in place of the packaged default (as the live routing service's `routing.policy_file`)."""
    baseline = BASELINES[policy]
    if routing_policy:
        baseline = replace(baseline, routing_policy=routing_policy)
    summary = simulator_for(baseline, config, RunOptions(seed=seed)).run(turns, policy).summary
    total = max(1, summary.turns)
    cached = summary.cached_tokens / summary.prompt_tokens if summary.prompt_tokens else 0.0
    return Profile({k: v / total for k, v in summary.decisions.items()}, summary.pulled_fraction, cached)


def agree(sim: Profile, live: Profile, tolerance: float = 0.05) -> list[str]:
    """Where the two differ by more than `tolerance`; empty when they agree."""
    out = []
    for decision in sorted(set(sim.decision_shares) | set(live.decision_shares)):
        a = sim.decision_shares.get(decision, 0.0)
        b = live.decision_shares.get(decision, 0.0)
        if abs(a - b) > tolerance:
            out.append(f"{decision}: simulated {a:.3f}, live {b:.3f}")
    if abs(sim.pulled_fraction - live.pulled_fraction) > tolerance:
        out.append(f"pulled fraction: simulated {sim.pulled_fraction:.3f}, live {live.pulled_fraction:.3f}")
    sim_cached, live_cached = sim.cached_fraction, live.cached_fraction
    if sim_cached is not None and live_cached is not None and abs(sim_cached - live_cached) > tolerance:
        out.append(f"prefix-cache fraction: simulated {sim_cached:.3f}, live {live_cached:.3f}")
    return out
