"""The simulator's ranking of the fronts the live comparison runs, on the comparison's own workload.

The live comparison (`kvplane.bench.compare`) drives multi-turn chats through kvplane's gateways
(routing over gRPC, and in the gateway's own process), vllm-router and vLLM's example proxy on
2 P + 2 D sim-engines. The simulator has a counterpart of each front (`LIVE_COUNTERPARTS`:
`kvplane` with each gateway's hop for every kvplane front, asking for prefill on decode where that
front's gateway does, `cache-aware`, vllm-router's default policy, for vllm-router, and
`no-reuse`, round-robin P and D with P's prefix caches on, for the example proxy). `simulate`
runs the same chats (`compare_workload.shapes`) through them, closed loop as the live client sends
them: a conversation's next turn comes when its previous answer is done, and at most
`concurrency` conversations are in flight, and each pays its front's own hop (`FRONT_HOPS_S`).
`disagreements` compares the two orders of the fronts, on TTFT of later turns and on the share of
their prompt tokens reused, only where the live gap is clear of the live run's own spread;
`order_disagreements` compares them with the recorded comparison's p50s (`RecordedFront`), where
a live tie may come out either way in the simulator, within a tolerance.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations, permutations
from typing import Any

from kvplane.bench.compare_fronts import ALL_FRONTS, PREFILL_ON_DECODE_FRONTS, PREFILL_ON_DECODE_FRONTS_BEFORE
from kvplane.bench.compare_workload import Workload, shapes
from kvplane.bench.sim.baselines import (
    BASELINES,
    COLOCATED_ROUTE_S,
    EVENT_LAG_S,
    EXAMPLE_PROXY_HOP_S,
    MEASURED_ROUTE_S,
    VLLM_ROUTER_HOP_S,
    simulator_for,
)
from kvplane.bench.sim.cluster import ClusterSpec
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.engine import SimConfig
from kvplane.bench.workloads.turns import Turn

# Live front -> the simulator's baseline that stands for it.
LIVE_COUNTERPARTS: dict[str, str] = {
    "kvplane": "kvplane",
    # The same routing in the gateway's own process: the same policy, its own hop.
    "kvplane-colocated": "kvplane",
    "vllm-router": "cache-aware",
    "example-proxy": "no-reuse",
    # kvplane's gateway with gateway.prefill_on_decode: the same policy, and D may prefill.
    "kvplane-decode-prefill": "kvplane",
}


def recorded_prefill_on_decode(config: Mapping[str, Any]) -> frozenset[str]:
    """The live fronts whose gateway let the holder D prefill short turns itself, as a recorded
    comparison's configuration says (one recorded before the gateway's default changed does not
    say: there, only `kvplane-decode-prefill`'s did). The simulated front asks routing with
    prefill_on_decode_ok where its live gateway did."""
    fronts = config.get("prefill_on_decode_fronts")
    if fronts is None:
        return PREFILL_ON_DECODE_FRONTS_BEFORE
    return frozenset(str(front) for front in fronts)


# The comparison's stack runs its prefill engines with KV events on (`start_stack`'s default):
# routing knows what P's caches hold from their events, which reach it this late, not from its
# own record of the prompts it sent. Without events, routing would take a P whose prefix cache is
# off (workload B) for one that holds the previous prompt, and recompute a turn that live it pulls.
LIVE_EVENT_LAG_S = EVENT_LAG_S
# The fronts every comparison runs (`kvplane.bench.compare`'s defaults, less the zero-hop clients).
DEFAULT_FRONTS = tuple(front for front in ALL_FRONTS if front in LIVE_COUNTERPARTS)
# Live front -> its own hop (s), as measured in the comparison (see baselines.py).
FRONT_HOPS_S: dict[str, float] = {
    "kvplane": MEASURED_ROUTE_S,
    "kvplane-colocated": COLOCATED_ROUTE_S,
    "vllm-router": VLLM_ROUTER_HOP_S,
    "example-proxy": EXAMPLE_PROXY_HOP_S,
    # The same gateway, asking the same routing replica over gRPC.
    "kvplane-decode-prefill": MEASURED_ROUTE_S,
}
# The dev stack's engines (`kvplane.services.devstack`): 2 P + 2 D of 16,384 blocks of 16 tokens.
STACK_NODES = 2
STACK_KV_TOKENS = 16_384 * 16
# A later turn is faster on one side in at least this share of pairs, or the gap is not clear.
CLEAR_TTFT_DOMINANCE = 0.75
# Reuse shares closer than this are not a clear gap (one block per front gives no spread of its own).
CLEAR_REUSE_GAP = 0.05
# How far the simulator may order two fronts the other way round from the recorded comparison,
# the live gap (between the fronts' spreads over the repeats) and the simulated one summed: on
# TTFT p50 as a share of the zero-hop client's p50, and on the share of prompt tokens reused. A
# live gap wider than this must come out in the same order. 5%: the simulator's TTFT is the
# engines' modelled work alone (about half the live TTFT at one in flight), so a few ms of
# unmodelled per-turn cost move its order of fronts that live are level.
ORDER_TOLERANCE = 0.05


@dataclass(frozen=True)
class FrontSample:
    """One front's later turns: each TTFT (ms), and the share of their prompt tokens reused."""

    later_ttft_ms: Sequence[float]
    reuse_share: float


# A turn through P on the comparison's sim-engines spends this long on D before D's first step:
# D's own TTFT at one conversation in flight less the modelled step, over every front whose turns
# all go through P (`front_hops.handoff_ms` on `front_hops.HANDOFF_SOURCE`). Machine time (NIXL,
# the blocks' check, HTTP), not modelled time: `speedup` leaves it as it is.
SIM_ENGINE_HANDOFF_S = 0.023500


def sim_engine_costs(speedup: float = 1.0) -> SimCosts:
    """What work costs on the comparison's sim-engines, which differ from the published figures
    the simulator's defaults are fitted to: a prefill takes the timing model's time for the
    tokens it computes only (held and pulled tokens cost no compute), and a turn D prefills
    itself that time alone, its first token with it; a turn through P pays D's hand-off on top
    (`SIM_ENGINE_HANDOFF_S`, measured); a pull reads the `sim-model`'s KV (16,384 bytes per
    16-token block) over loopback NIXL, 3.7-4.8 GB/s as measured on this kind of machine
    (shared/reference/README.md); its fixed cost is a guess."""
    timing = SimCosts().timing.with_speedup(speedup)
    return SimCosts(
        timing=timing,
        kv_bytes_per_token=16_384 // 16,
        link_bytes_per_s=4e9,
        transfer_overhead_s=0.002,
        pulled_token_s=0.0,
        handoff_fixed_s=SIM_ENGINE_HANDOFF_S,
        local_chunk_decode_step=False,
    )


# How much an answer's decode time on the sim-engines varies from turn to turn beyond what the
# simulator models (a D's step time with the answers running there), as a share of it
# (`SimConfig.decode_spread`). Live, the time per output token of a turn varies by 0.55-0.90% of
# its mean (standard deviation; the router and the zero-hop client at 8 and 32 in flight in
# `compare_2b1e153`), part of it the batch the simulator models. 0.3% is the value that puts the
# router's simulated TTFT p99 where the live runs have it with P's cache on (183 and 197 ms at 8
# and 32 in flight, against 182.6-185.6 and 198.2-201.4 live at `cdedf69` and `2b1e153`). It
# matters: with every answer exactly as long as modelled, the chats on each P never leave the
# order they settled into, no turn meets another on P, and a round-robin front (the example
# proxy) sends every later turn of a chat to the P that holds it; live, the order drifts.
LIVE_DECODE_SPREAD = 0.003


def sim_config(prefix_cache: bool, speedup: float = 1.0, think_s: float = 0.0, seed: int = 0) -> SimConfig:
    """The dev stack's fleet, as its sim-engines run it (Qwen3-32B timing divided by `speedup`),
    driven closed loop as the comparison's client drives it, pausing `think_s` after each answer;
    each answer's decode time varies as live (`LIVE_DECODE_SPREAD`, drawn from `seed`)."""
    costs = sim_engine_costs(speedup)
    kv = STACK_KV_TOKENS * costs.kv_bytes_per_token
    cluster = ClusterSpec(
        prefill_nodes=STACK_NODES,
        decode_nodes=STACK_NODES,
        decode_kv_capacity_bytes=kv,
        prefill_cache_bytes=kv if prefix_cache else 0,
        prefill_kv_capacity_bytes=kv,
    )
    return SimConfig(
        cluster=cluster,
        costs=costs,
        closed_loop=True,
        think_s=think_s,
        decode_spread=LIVE_DECODE_SPREAD,
        decode_spread_seed=seed,
    )


def comparison_turns(
    workload: Workload, concurrency: int, repeat: int, costs: SimCosts
) -> tuple[list[Turn], int]:
    """The block's chats as turns, and the tokens of their first prompts.

    The live client sends a chat's next turn the moment the answer before it is done (after the
    workload's pause): each later turn is given its chat's start as its arrival, so the
    simulator's closed loop (`SimConfig.closed_loop`) holds it until then, and the schedule the
    turns settle into on each P is the engines' own. An estimate of the time a turn takes
    (its whole prompt's prefill and its decode with `concurrency` requests decoding) only places
    a chat beyond the first `concurrency`, at the estimated end of the one before it in its slot.
    """
    running = min(concurrency, workload.conversations(concurrency))
    slots = [0.0] * running
    turns: list[Turn] = []
    first_tokens = 0
    for shape in shapes(workload, concurrency, repeat):
        free = heapq.heappop(slots)
        start = max(free, shape.start_s)
        t = start
        prompt = shape.first_tokens
        first_tokens += prompt
        previous = 0
        for index, user in enumerate((0, *shape.user_tokens)):
            prompt = previous + user if index else prompt
            turns.append(
                Turn(
                    start,
                    f"c{shape.index}",
                    index,
                    prompt,
                    workload.answer_tokens,
                    reused_prefix_tokens=previous,
                    previous_context_tokens=previous,
                )
            )
            t += costs.prefill_s(prompt) + costs.decode_s(workload.answer_tokens, running)
            t += workload.think_s
            previous = prompt + workload.answer_tokens
        heapq.heappush(slots, t)
    turns.sort(key=lambda x: (x.arrival_s, x.conversation, x.turn_index))
    return turns, first_tokens


def simulate(
    workload: Workload,
    concurrency: int,
    repeat: int = 0,
    *,
    prefix_cache: bool = True,
    speedup: float = 1.0,
    fronts: Sequence[str] = DEFAULT_FRONTS,
    prefill_on_decode: frozenset[str] = PREFILL_ON_DECODE_FRONTS,
) -> dict[str, FrontSample]:
    """Each live front's counterpart over the block's chats; the fronts in `prefill_on_decode`
    let routing send a turn to its D alone, as their gateways do by default."""
    config = sim_config(prefix_cache, speedup, workload.think_s, seed=repeat)
    turns, first_tokens = comparison_turns(workload, concurrency, repeat, config.costs)
    firsts = Counter(t.prompt_tokens for t in turns if t.turn_index == 0)
    out = {}
    for front in fronts:
        baseline = replace(
            BASELINES[LIVE_COUNTERPARTS[front]],
            control_path_s=FRONT_HOPS_S[front],
            prefill_on_decode=front in prefill_on_decode,
        )
        if baseline.router == "policy":
            baseline = replace(baseline, event_lag_s=LIVE_EVENT_LAG_S, event_loss=0.0)
        result = simulator_for(baseline, config).run(turns, front)
        later = []
        for tokens, ttft in zip(result.prompt_tokens, result.ttft_s, strict=True):
            if firsts[tokens] > 0:
                firsts[tokens] -= 1  # a first turn (by its prompt's length)
            else:
                later.append(ttft * 1000.0)
        firsts = Counter(t.prompt_tokens for t in turns if t.turn_index == 0)
        summary = result.summary
        later_prompt = summary.prompt_tokens - first_tokens
        out[front] = FrontSample(later, summary.reused_tokens / later_prompt if later_prompt else 0.0)
    return out


def simulate_repeats(
    workload: Workload,
    concurrency: int,
    repeats: int,
    *,
    prefix_cache: bool = True,
    fronts: Sequence[str] = DEFAULT_FRONTS,
    prefill_on_decode: frozenset[str] = PREFILL_ON_DECODE_FRONTS,
) -> dict[str, FrontSample]:
    """`simulate` over each repeat's chats, pooled as the comparison pools its blocks: every later
    turn's TTFT, and the reuse share averaged over the repeats (their prompts are alike)."""
    runs = [
        simulate(
            workload,
            concurrency,
            r,
            prefix_cache=prefix_cache,
            fronts=fronts,
            prefill_on_decode=prefill_on_decode,
        )
        for r in range(repeats)
    ]
    return {
        front: FrontSample(
            [x for run in runs for x in run[front].later_ttft_ms],
            sum(run[front].reuse_share for run in runs) / len(runs),
        )
        for front in fronts
    }


@dataclass(frozen=True)
class RecordedFront:
    """One front at one concurrency as the recorded comparison gives it: TTFT p50 of later turns
    against the zero-hop client's, pooled over the repeats and its lowest and highest in one
    repeat, and the share of their prompt tokens reused."""

    p50_ratio: float
    p50_ratio_low: float
    p50_ratio_high: float
    reuse_share: float

    @property
    def spread(self) -> tuple[float, float]:
        """The ratios the repeats leave possible (the pooled one may lie outside one repeat's)."""
        return min(self.p50_ratio, self.p50_ratio_low), max(self.p50_ratio, self.p50_ratio_high)


def live_lead(a: RecordedFront, b: RecordedFront) -> float:
    """How far a's TTFT p50 is ahead of b's live, as a share of the zero-hop client's p50: the gap
    between their spreads over the repeats (negative: a is behind), 0 where the spreads overlap."""
    a_low, a_high = a.spread
    b_low, b_high = b.spread
    if a_high < b_low:
        return b_low - a_high
    if b_high < a_low:
        return b_high - a_low
    return 0.0


def order_disagreements(
    live: Mapping[str, RecordedFront], sim: Mapping[str, FrontSample], reference_ms: float
) -> list[str]:
    """Pairs the simulator orders the other way round from live by more than `ORDER_TOLERANCE`.

    For every ordered pair (a, b): live, a's pooled p50 is behind b's or level with it, and the
    simulator puts a ahead (TTFT p50 as a share of `reference_ms`, the zero-hop client's live
    p50), with the live gap (between the repeats' spreads, `live_lead`: 0 where they overlap)
    and the simulated one together above the tolerance. So a pair the repeats keep apart by more
    than the tolerance must come out in the same order, and a tie within the repeats' spread may
    come out the other way by at most the tolerance. Reuse likewise, on the shares, whose record
    has no spread over repeats.
    """
    out = []
    for a, b in permutations(sorted(set(live) & set(sim)), 2):
        lead = live_lead(live[a], live[b])
        sim_a, sim_b = _median(sim[a].later_ttft_ms), _median(sim[b].later_ttft_ms)
        sim_lead = (sim_b - sim_a) / reference_ms
        behind = live[a].p50_ratio >= live[b].p50_ratio
        if behind and sim_lead > 0 and sim_lead - lead > ORDER_TOLERANCE:
            out.append(
                f"TTFT: live {a} {live[a].p50_ratio:.2f}x against {b} {live[b].p50_ratio:.2f}x,"
                f" simulated {sim_a:.0f} ms against {sim_b:.0f} ms ({sim_lead - lead:.1%} of the"
                f" zero-hop client's {reference_ms:.0f} ms the other way)"
            )
        reuse_lead = live[a].reuse_share - live[b].reuse_share
        sim_reuse_lead = sim[a].reuse_share - sim[b].reuse_share
        if reuse_lead <= 0 < sim_reuse_lead and sim_reuse_lead - reuse_lead > ORDER_TOLERANCE:
            out.append(
                f"reuse: live {a} {live[a].reuse_share:.1%} against {b} {live[b].reuse_share:.1%},"
                f" simulated {sim[a].reuse_share:.1%} against {sim[b].reuse_share:.1%}"
            )
    return out


def dominance(a: Sequence[float], b: Sequence[float]) -> float:
    """Share of pairs (x from a, y from b) with x < y (ties count half)."""
    if not a or not b:
        return 0.5
    wins = sum((x < y) + 0.5 * (x == y) for x in a for y in b)
    return wins / (len(a) * len(b))


def disagreements(live: Mapping[str, FrontSample], sim: Mapping[str, FrontSample]) -> list[str]:
    """Pairs of fronts whose live order is clear and the simulator's is the other way round.

    TTFT: a front is clearly faster live when its later turns beat the other's in at least
    `CLEAR_TTFT_DOMINANCE` of all pairs; the simulator agrees when it puts that front's median
    first too. Reuse: a gap of more than `CLEAR_REUSE_GAP` live, and the same sign simulated.
    """
    out = []
    for a, b in combinations(sorted(set(live) & set(sim)), 2):
        faster = dominance(live[a].later_ttft_ms, live[b].later_ttft_ms)
        if faster >= CLEAR_TTFT_DOMINANCE or faster <= 1 - CLEAR_TTFT_DOMINANCE:
            first, second = (a, b) if faster >= CLEAR_TTFT_DOMINANCE else (b, a)
            if _median(sim[first].later_ttft_ms) > _median(sim[second].later_ttft_ms):
                out.append(
                    f"TTFT: live {first} beats {second} in {max(faster, 1 - faster):.0%} of pairs,"
                    f" simulated median {_median(sim[first].later_ttft_ms):.0f} ms against"
                    f" {_median(sim[second].later_ttft_ms):.0f} ms"
                )
        gap = live[a].reuse_share - live[b].reuse_share
        if abs(gap) > CLEAR_REUSE_GAP and (sim[a].reuse_share - sim[b].reuse_share) * gap <= 0:
            out.append(
                f"reuse: live {a} {live[a].reuse_share:.0%} against {b} {live[b].reuse_share:.0%},"
                f" simulated {sim[a].reuse_share:.0%} against {sim[b].reuse_share:.0%}"
            )
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return float("nan")
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
