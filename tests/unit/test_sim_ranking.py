"""The simulator's side of the live ranking check: the comparison's chats, and when orders disagree."""

from __future__ import annotations

import pytest

from kvplane.bench import compare
from kvplane.bench.compare_fronts import PREFILL_ON_DECODE_FRONTS
from kvplane.bench.compare_workload import Workload, shapes
from kvplane.bench.sim import ranking
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.ranking import (
    FRONT_HOPS_S,
    ORDER_TOLERANCE,
    FrontSample,
    RecordedFront,
    comparison_turns,
    disagreements,
    dominance,
    order_disagreements,
    recorded_prefill_on_decode,
    simulate,
)

BASELINE_HOPS = dict(FRONT_HOPS_S)

WORKLOAD = Workload(turns=3, first_tokens=1400, user_tokens=900, answer_tokens=16, min_conversations=4)


def test_the_chats_are_the_comparisons_own_closed_loop() -> None:
    costs = SimCosts()
    turns, first_tokens = comparison_turns(WORKLOAD, 2, 0, costs)
    chats = shapes(WORKLOAD, 2, 0)
    assert first_tokens == sum(s.first_tokens for s in chats)
    assert len(turns) == 4 * 3
    c0 = [t for t in turns if t.conversation == "c0"]
    shape = chats[0]
    assert [t.prompt_tokens for t in c0] == [
        shape.first_tokens,
        shape.first_tokens + 16 + shape.user_tokens[0],
        shape.first_tokens + 2 * 16 + sum(shape.user_tokens),
    ]
    assert all(t.continues_context for t in c0[1:])
    # A later turn is given its chat's start: the simulator's closed loop holds it until the
    # answer before it is done, whenever that is.
    assert all(t.arrival_s == c0[0].arrival_s for t in c0)
    # Two chats in flight at a time: the third starts in the slot of the one estimated to end first.
    ends = []
    for chat in ("c0", "c1"):
        own = [t for t in turns if t.conversation == chat]
        ends.append(
            own[0].arrival_s + sum(costs.prefill_s(t.prompt_tokens) + costs.decode_s(16, 2) for t in own)
        )
    third_start = min(t.arrival_s for t in turns if t.conversation == "c2")
    assert third_start == pytest.approx(max(min(ends), chats[2].start_s))


def test_with_p_caches_off_only_kvplane_reuses() -> None:
    sim = simulate(WORKLOAD, 4, prefix_cache=False)
    assert sim["kvplane"].reuse_share > 0.1
    assert sim["vllm-router"].reuse_share == sim["example-proxy"].reuse_share == 0.0
    assert all(len(s.later_ttft_ms) == 8 for s in sim.values())


def test_dominance_counts_pairs() -> None:
    assert dominance([1, 2], [3, 4]) == 1.0
    assert dominance([3, 4], [1, 2]) == 0.0
    assert dominance([1, 3], [2, 2]) == 0.5


def test_only_a_clear_live_gap_is_held_against_the_simulator() -> None:
    live = {
        "a": FrontSample([100, 110, 120, 130], 0.70),
        "b": FrontSample([200, 210, 220, 230], 0.72),  # reuse within the margin of a's
        "c": FrontSample([105, 205, 115, 215], 0.20),
    }
    agreeing = {
        "a": FrontSample([150, 160], 0.60),
        "b": FrontSample([170, 180], 0.50),
        "c": FrontSample([140, 190], 0.10),
    }
    assert disagreements(live, agreeing) == []
    reversed_ = dict(agreeing, a=FrontSample([190, 200], 0.05))
    found = disagreements(live, reversed_)
    assert len(found) == 2
    assert found[0].startswith("TTFT: live a beats b") and found[1].startswith("reuse: live a 70% against c")


def _front(ratio: float, low: float, high: float, reuse: float = 0.7) -> RecordedFront:
    return RecordedFront(ratio, low, high, reuse)


def test_a_tie_within_the_repeats_may_come_out_either_way_by_the_tolerance_only() -> None:
    # Level live: the spreads over the repeats overlap.
    live = {"a": _front(0.93, 0.91, 0.94), "b": _front(0.96, 0.92, 1.03)}
    within = {"a": FrontSample([103.0], 0.7), "b": FrontSample([100.0], 0.7)}  # b ahead by 3%
    assert order_disagreements(live, within, reference_ms=100.0) == []
    beyond = {"a": FrontSample([107.0], 0.7), "b": FrontSample([100.0], 0.7)}  # b ahead by 7%
    found = order_disagreements(live, beyond, reference_ms=100.0)
    assert len(found) == 1 and found[0].startswith("TTFT: live b 0.96x against a 0.93x")


def test_a_gap_the_repeats_keep_apart_must_keep_its_order() -> None:
    live = {"a": _front(1.00, 1.00, 1.02), "b": _front(1.06, 1.06, 1.08)}  # a ahead by 4 points
    assert (
        order_disagreements(live, {"a": FrontSample([100.0], 0.7), "b": FrontSample([101.0], 0.7)}, 100.0)
        == []
    )
    # b ahead by 1.5% simulated: with the live gap, 5.5% the other way.
    flipped = {"a": FrontSample([101.5], 0.7), "b": FrontSample([100.0], 0.7)}
    assert len(order_disagreements(live, flipped, 100.0)) == 1
    assert ORDER_TOLERANCE == 0.05


def test_reuse_is_held_to_the_recorded_shares() -> None:
    live = {"a": _front(1.0, 1.0, 1.0, 0.739), "b": _front(1.0, 1.0, 1.0, 0.686)}
    agreeing = {"a": FrontSample([100.0], 0.71), "b": FrontSample([100.0], 0.70)}
    assert order_disagreements(live, agreeing, 100.0) == []
    level = dict(live, b=_front(1.0, 1.0, 1.0, 0.72))  # 1.9 points apart live
    within = {"a": FrontSample([100.0], 0.70), "b": FrontSample([100.0], 0.72)}  # 2 points the other way
    assert order_disagreements(level, within, 100.0) == []
    reversed_ = {"a": FrontSample([100.0], 0.676), "b": FrontSample([100.0], 0.704)}
    found = order_disagreements(live, reversed_, 100.0)
    assert found == ["reuse: live b 68.6% against a 73.9%, simulated 70.4% against 67.6%"]


def test_every_front_pays_its_own_hop(monkeypatch: pytest.MonkeyPatch) -> None:
    one = Workload(turns=2, first_tokens=1400, user_tokens=900, answer_tokens=16, min_conversations=1)
    assert all(hop >= 0 for hop in BASELINE_HOPS.values())
    # A hop of its own for each front (the recorded ones may be equal, or 0).
    hops = {front: 0.010 * (i + 1) for i, front in enumerate(sorted(FRONT_HOPS_S))}
    for front, hop in hops.items():
        monkeypatch.setitem(FRONT_HOPS_S, front, hop)
    with_hops = simulate(one, 1, prefix_cache=False)
    for front in FRONT_HOPS_S:
        monkeypatch.setitem(FRONT_HOPS_S, front, 0.0)
    without = simulate(one, 1, prefix_cache=False)
    for front, sample in with_hops.items():
        hop_ms = 1000.0 * hops[front]
        assert sample.later_ttft_ms[0] == pytest.approx(without[front].later_ttft_ms[0] + hop_ms)


def test_a_record_says_which_fronts_let_d_prefill_and_an_older_one_means_the_decode_prefill_front() -> None:
    assert recorded_prefill_on_decode(
        {"prefill_on_decode_fronts": ["kvplane", "kvplane-decode-prefill"]}
    ) == {
        "kvplane",
        "kvplane-decode-prefill",
    }
    assert recorded_prefill_on_decode({"prefill_on_decode_fronts": []}) == frozenset()
    # Recorded before every kvplane gateway let D prefill by default.
    assert recorded_prefill_on_decode({}) == {"kvplane-decode-prefill"}
    # Every kvplane front does now, and a comparison's record says so.
    assert {"kvplane", "kvplane-colocated", "kvplane-decode-prefill"} <= PREFILL_ON_DECODE_FRONTS
    config = compare.CompareConfig(fronts=("kvplane", "vllm-router", "zero-hop-reuse"))
    written = compare.document(config, [], ["compare"])["config"]
    assert recorded_prefill_on_decode(written) == {"kvplane"}


def test_answers_vary_as_live_so_a_round_robin_front_misses_some_histories(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def misses() -> int:
        runs = [simulate(Workload(min_conversations=1), 8, repeat) for repeat in range(4)]
        return sum(run["example-proxy"].reuse_share < run["vllm-router"].reuse_share - 0.01 for run in runs)

    assert misses() >= 1
    # With every answer exactly as long as modelled, the chats keep their order on each P, and
    # the example proxy's round-robin sends every later turn to the P that holds its history.
    monkeypatch.setattr(ranking, "LIVE_DECODE_SPREAD", 0.0)
    assert misses() == 0
