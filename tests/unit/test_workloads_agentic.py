"""The synthetic agentic generator: seeded, ordered, growing contexts with a heavy tail."""

from __future__ import annotations

import itertools
from collections import defaultdict

from kvplane.bench.workloads import AgenticWorkload, Turn, agentic_turns

SMALL = AgenticWorkload(seed=3, sessions_per_s=0.5, duration_s=1200.0)


def _turns(spec: AgenticWorkload = SMALL) -> list[Turn]:
    return list(agentic_turns(spec))


def test_the_same_seed_gives_the_same_turns() -> None:
    assert _turns() == _turns()


def test_another_seed_gives_other_turns() -> None:
    other = AgenticWorkload(seed=4, sessions_per_s=0.5, duration_s=1200.0)
    assert _turns() != _turns(other)


def test_turns_arrive_in_order_and_respect_max_turns() -> None:
    turns = _turns()
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(turns))
    capped = list(agentic_turns(AgenticWorkload(seed=3, sessions_per_s=5, duration_s=1e9, max_turns=500)))
    assert len(capped) == 500


def test_contexts_grow_and_mostly_continue_exactly() -> None:
    by_session: dict[str, list[Turn]] = defaultdict(list)
    for t in _turns():
        by_session[t.conversation].append(t)
    continued = later = 0
    for session in by_session.values():
        assert [t.turn_index for t in session] == list(range(len(session)))
        assert session[0].reused_prefix_tokens == 0
        for prev, cur in itertools.pairwise(session):
            later += 1
            assert cur.previous_context_tokens == prev.prompt_tokens + prev.output_tokens
            assert cur.reused_prefix_tokens <= cur.previous_context_tokens
            if cur.continues_context:
                continued += 1
                assert cur.prompt_tokens > prev.context_tokens
    assert later > 0 and 0.85 < continued / later < 1.0


def test_think_times_have_a_tail_beyond_the_engine_ttl() -> None:
    last: dict[str, float] = {}
    gaps = []
    for t in _turns(AgenticWorkload(seed=5, sessions_per_s=2.0, duration_s=1800.0)):
        if t.conversation in last:
            gaps.append(t.arrival_s - last[t.conversation])
        last[t.conversation] = t.arrival_s
    beyond = sum(1 for g in gaps if g > 480.0) / len(gaps)
    short = sum(1 for g in gaps if g < 30.0) / len(gaps)
    assert 0.01 < beyond < 0.15
    assert short > 0.5  # tool calls dominate


def test_every_session_starts_with_the_shared_system_prompt() -> None:
    firsts = [t for t in _turns() if t.turn_index == 0]
    assert all(t.prompt_tokens > SMALL.system_prompt_tokens for t in firsts)
