"""The Mooncake adapter: the trace README's figures, and the linking rules on small traces."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvplane.bench.workloads import (
    DEFAULT_TRACE,
    TraceFormat,
    conversation_turns,
    read_requests,
    trace_statistics,
)

needs_trace = pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="shared Mooncake trace not present")


@needs_trace
def test_adapter_reproduces_the_trace_readme_figures() -> None:
    stats = trace_statistics(read_requests(DEFAULT_TRACE))
    assert stats.requests == 12_031
    assert stats.continuations == 4_103
    assert stats.resent_block_share == pytest.approx(0.337, abs=0.0005)
    assert stats.gap_quantiles_s[0.10] == pytest.approx(42, abs=1)
    assert stats.gap_quantiles_s[0.50] == pytest.approx(126, abs=1)
    assert stats.gap_quantiles_s[0.90] == pytest.approx(486, abs=1)
    assert stats.gap_quantiles_s[0.99] == pytest.approx(1_482, abs=1)
    assert stats.share_of_gaps_over(480.0) == pytest.approx(0.102, abs=0.0005)
    assert stats.input_quantiles == {0.5: 6_909, 0.9: 27_367}
    assert stats.max_input == 126_195


@needs_trace
def test_every_continuation_becomes_a_later_turn_of_a_conversation() -> None:
    turns = list(conversation_turns(read_requests(DEFAULT_TRACE)))
    assert len(turns) == 12_031
    later = [t for t in turns if t.turn_index > 0]
    # 4,658 requests share more than the system prompt's block with an earlier one (4,103 share 3
    # blocks, as the README counts); 13 of them open another line over a prefix whose conversation
    # had moved on.
    assert len(later) == 4_645
    assert len({t.conversation for t in turns}) == 12_031 - 4_645
    assert all(0 < t.reused_prefix_tokens <= t.prompt_tokens for t in later)
    assert all(t.arrival_s <= u.arrival_s for t, u in itertools.pairwise(turns))


def _write(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for ts, inp, out, ids in rows:
            f.write(
                json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids})
                + "\n"
            )
    return path


def test_a_shared_system_prompt_alone_is_not_a_continuation(tmp_path: Path) -> None:
    trace = _write(tmp_path / "t.jsonl", [(0, 40, 5, [0, 1, 2, 3]), (1000, 40, 5, [0, 9, 10, 11])])
    turns = list(conversation_turns(read_requests(trace), TraceFormat(block_size=10)))
    assert [t.conversation for t in turns] == ["c0", "c1"]
    assert [t.turn_index for t in turns] == [0, 0]


def test_a_verbatim_continuation_reuses_the_previous_prompt_and_answer(tmp_path: Path) -> None:
    rows = [
        (0, 40, 5, [0, 1, 2, 3]),
        # Re-sends all 4 blocks and is longer than 40 + 5: the whole context is reused.
        (2000, 60, 5, [0, 1, 2, 3, 4, 5]),
        # Shares only 3 leading blocks of its predecessor: an edited history.
        (5000, 70, 5, [0, 1, 2, 7, 8, 9, 10]),
    ]
    turns = list(
        conversation_turns(read_requests(_write(tmp_path / "t.jsonl", rows)), TraceFormat(block_size=10))
    )
    assert [t.conversation for t in turns] == ["c0", "c0", "c0"]
    assert turns[1].reused_prefix_tokens == 45 and turns[1].continues_context
    assert turns[2].reused_prefix_tokens == 30 and not turns[2].continues_context
    assert turns[2].previous_context_tokens == 65


def test_the_continuation_rule_is_configurable(tmp_path: Path) -> None:
    rows = [(0, 40, 5, [0, 1, 2, 3]), (1000, 60, 5, [0, 1, 8, 9, 10, 11])]
    trace = _write(tmp_path / "t.jsonl", rows)
    loose = list(conversation_turns(read_requests(trace), TraceFormat(block_size=10)))
    strict = list(conversation_turns(read_requests(trace), TraceFormat(block_size=10, min_shared_blocks=3)))
    assert strict[1].turn_index == 0
    assert loose[1].turn_index == 1 and loose[1].reused_prefix_tokens == 20


def test_a_follow_up_to_a_short_history_continues_its_conversation(tmp_path: Path) -> None:
    # The first prompt is the system prompt's block and one of its own: the follow-up re-sends both.
    rows = [(0, 15, 4, [0, 1]), (3000, 30, 5, [0, 1, 2])]
    turns = list(
        conversation_turns(read_requests(_write(tmp_path / "t.jsonl", rows)), TraceFormat(block_size=10))
    )
    assert [t.conversation for t in turns] == ["c0", "c0"]
    assert turns[1].turn_index == 1 and turns[1].reused_prefix_tokens == 19 and turns[1].continues_context


def test_a_new_line_over_a_prefix_its_conversation_left_is_another_conversation(tmp_path: Path) -> None:
    rows = [
        (0, 40, 5, [0, 1, 2, 3]),
        # c0 goes on with an edited history: it no longer holds block 3.
        (1000, 50, 5, [0, 1, 2, 8, 9]),
        # Another session re-sends the first request's four blocks: not c0's history any more.
        (2000, 50, 5, [0, 1, 2, 3, 4]),
    ]
    turns = list(
        conversation_turns(read_requests(_write(tmp_path / "t.jsonl", rows)), TraceFormat(block_size=10))
    )
    assert [t.conversation for t in turns] == ["c0", "c0", "c1"]
    assert turns[2].turn_index == 0 and turns[2].reused_prefix_tokens == 0
    # What it shares with the first request is named, for prefix caches across conversations.
    assert turns[2].block_ids[:4] == turns[0].block_ids == (0, 1, 2, 3)
    assert turns[2].block_id_tokens == 10
