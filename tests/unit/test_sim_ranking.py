"""The simulator's side of the live ranking check: the comparison's chats, and when orders disagree."""

from __future__ import annotations

import pytest

from kvplane.bench.compare_workload import Workload, shapes
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.ranking import (
    FrontSample,
    comparison_turns,
    disagreements,
    dominance,
    simulate,
)

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
    # A turn comes when the previous one's answer is done; two chats in flight at a time.
    assert c0[1].arrival_s == pytest.approx(
        c0[0].arrival_s + costs.prefill_s(c0[0].prompt_tokens) + costs.decode_s(16, 2)
    )
    third_start = min(t.arrival_s for t in turns if t.conversation == "c2")
    ends = sorted(max(t.arrival_s for t in turns if t.conversation == c) for c in ("c0", "c1"))
    assert third_start > ends[0]


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
