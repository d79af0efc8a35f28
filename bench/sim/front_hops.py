"""Each front's hop, derived from the live comparison's record (`bench/results/compare.json`).

A front's hop is the time it adds to a turn's TTFT on top of the engines' own work: for an HTTP
front, the request's way in, its routing, the P leg's answer back through it and the D leg out
(before P and between P and D). The comparison times none of it apart from the engines except
kvplane's Route call, so the hop is read off the TTFT it leaves behind: at one conversation in
flight (no queueing), a front's later-turn TTFT p50 minus that of the zero-hop client (no front:
P leg then D leg straight to the engines) whose prompt-token split is closest to the front's,
less the prefill of the tokens the front computed beyond that client's (per later turn, by the
sim-engine's timing model), averaged over the workloads. A hop is never less than what is timed
on the front's path (kvplane's gateways: their mean Route call at one in flight, workload A), nor
below 0.

D's hand-off on the comparison's sim-engines is read off the same kind of record: a turn through
P reaches D's first step that long after it reaches D (`handoff_ms`).

The per-turn noise of one live block at one in flight is about 10 ms, so these figures say which
front adds tens of ms and which does not, not a ms more or less.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.connector.simengine.timing_model import TimingModel

# The record the hops are read from, relative to the repository's root.
COMPARE_SOURCE = "bench/results/compare.json"
# The record D's hand-off is read from: the first with each engine's own TTFT in it.
HANDOFF_SOURCE = "bench/results/compare_acc6c4e.json"
ZERO_HOP_CLIENTS = ("zero-hop", "zero-hop-reuse")


def _rows(document: Mapping[str, Any], workload: str, concurrency: int) -> dict[str, Mapping[str, Any]]:
    rows: Sequence[Mapping[str, Any]] = document["workloads"][workload]["rows"]
    return {r["front"]: r for r in rows if r["concurrency"] == concurrency}


def ttft_excess_ms(
    document: Mapping[str, Any], front: str, workload: str, timing: TimingModel | None = None
) -> float:
    """The front's later-turn TTFT p50 at one in flight beyond the closest zero-hop client's, less
    the prefill of the extra tokens it computed per later turn (ms)."""
    timing = timing or TimingModel()
    rows = _rows(document, workload, 1)
    mine = rows[front]
    ref = min(
        (rows[c] for c in ZERO_HOP_CLIENTS if c in rows),
        key=lambda r: abs(r["computed_tokens"] - mine["computed_tokens"]),
    )
    extra_tokens = (mine["computed_tokens"] - ref["computed_tokens"]) / max(1, mine["later_turns"])
    extra_ms = extra_tokens * timing.prefill_per_token_s / timing.speedup * 1000.0
    return float(mine["ttft_p50_ms"] - ref["ttft_p50_ms"] - extra_ms)


# Fronts whose gateway times its Route call (over gRPC, or in its own process).
TIMED_ROUTE_FRONTS = ("kvplane", "kvplane-colocated")


def route_ms(
    document: Mapping[str, Any], workload: str = "A", concurrency: int = 1, front: str = "kvplane"
) -> float:
    """A kvplane front's mean Route call as its gateway timed it (ms)."""
    return float(_rows(document, workload, concurrency)[front]["route_ms"])


def front_hop_ms(document: Mapping[str, Any], front: str) -> float:
    """The front's hop (ms): its mean TTFT excess over the workloads, at least what is timed."""
    workloads = sorted(document["workloads"])
    excess = sum(ttft_excess_ms(document, front, w) for w in workloads) / len(workloads)
    timed = route_ms(document, front=front) if front in TIMED_ROUTE_FRONTS else 0.0
    return max(timed, excess, 0.0)


def handoff_ms(
    document: Mapping[str, Any], local_prefill_fronts: Sequence[str], timing: TimingModel | None = None
) -> float:
    """What a turn through P spends on D before its first step, on the sim-engines (ms): D's own
    TTFT (from the D leg's arrival: its NIXL read of P's blocks, their check, the way into D's
    loop, then one decode step) at one conversation in flight, less the modelled step, averaged
    over every front and workload whose turns all go through P (not `local_prefill_fronts`)."""
    timing = timing or TimingModel()
    step_ms = timing.decode_s(1) / timing.speedup * 1000.0
    own = [
        row["decode_engine_ttft_ms"]
        for workload in sorted(document["workloads"])
        for front, row in _rows(document, workload, 1).items()
        if front not in local_prefill_fronts and row.get("decode_engine_ttft_ms") is not None
    ]
    if not own:
        raise ValueError("the record has no decode engine's own TTFT at one in flight")
    return max(0.0, float(sum(own)) / len(own) - step_ms)
