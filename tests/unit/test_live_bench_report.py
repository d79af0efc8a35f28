"""The live benchmark's report: TTFT by decision, the decision mix, the control plane's cost, and
the comparison of later turns with a direct client without reuse."""

from __future__ import annotations

import asyncio
from typing import Any

from kvplane.bench.live import (
    CACHED,
    COMPUTED,
    PULLED,
    LiveResult,
    TurnResult,
    Workload,
    _conversations,
    comparison_report,
    report,
)


def test_report_compares_first_turns_with_the_direct_baseline_and_splits_by_decision() -> None:
    result = LiveResult(
        turns=[
            TurnResult("c0", 0, 4000, 100, "direct", 300.0, "direct"),
            TurnResult("c0", 0, 4000, 100, "recompute_no_handle", 320.0, "gateway"),
            TurnResult("c0", 1, 4300, 100, "pull", 200.0, "gateway"),
            TurnResult("c0", 2, 4600, 100, "recompute_cost", 330.0, "gateway"),
        ],
        sources={PULLED: 4099, CACHED: 0, COMPUTED: 12801},
    )
    text = report(result)
    assert "| gateway, later turns: pull | 1 | 200.0 |" in text
    assert "| direct to engines (turn 1) | 1 | 300.0 |" in text
    assert "+20.0 ms" in text
    assert "recompute_no_handle 33%" in text and "pull 33%" in text
    assert "24.3%" in text
    assert result.decision_shares() == {"recompute_no_handle": 1 / 3, "pull": 1 / 3, "recompute_cost": 1 / 3}


def test_comparison_uses_later_turns_only_and_gives_ratios_of_ttft_and_token_sources() -> None:
    ours = LiveResult(
        turns=[
            TurnResult("c0", 0, 4000, 100, "recompute_no_handle", 900.0, "gateway"),
            TurnResult("c0", 1, 4300, 100, "pull", 100.0, "gateway"),
            # The interleaved first-turn direct probe is not a later turn of either phase.
            TurnResult("c0", 0, 4000, 100, "direct", 5000.0, "direct"),
        ],
        sources={PULLED: 3000, CACHED: 1000, COMPUTED: 4000},
    )
    direct = LiveResult(
        turns=[
            TurnResult("d0", 0, 4000, 100, "direct", 800.0, "direct"),
            TurnResult("d0", 1, 4300, 100, "direct", 400.0, "direct"),
        ],
        sources={PULLED: 0, CACHED: 2000, COMPUTED: 6000},
    )
    text = comparison_report(ours, direct)
    assert "| TTFT p50 ms (1 vs 1 turns) | 100.0 | 400.0 | 0.25x |" in text
    assert "| TTFT p99 ms (1 vs 1 turns) | 100.0 | 400.0 | 0.25x |" in text
    assert "| prompt tokens pulled from D | 3,000 (37.5%) | 0 (0.0%) | n/a |" in text
    assert "| prompt tokens P's prefix cache | 1,000 (12.5%) | 2,000 (25.0%) | 0.50x |" in text
    assert "| prompt tokens computed | 4,000 (50.0%) | 6,000 (75.0%) | 0.67x |" in text


def test_two_phases_see_the_same_prompt_lengths_and_arrival_order_but_other_tokens() -> None:
    workload = Workload(conversations=3, turns=3, first_tokens=50, user_tokens=7, max_tokens=4, rate=1e6)

    async def run(salt: str) -> tuple[LiveResult, list[list[int]]]:
        prompts: list[list[int]] = []
        result = LiveResult()

        async def send(name: str, turn: int, body: dict[str, Any]) -> tuple[str, float, list[int]]:
            prompts.append(list(body["prompt"]))
            return "x", 1.0, [turn] * body["max_tokens"]

        await _conversations(workload, "m", "gateway", send, result, token_salt=salt)
        return result, prompts

    (a, pa), (b, pb) = asyncio.run(run("")), asyncio.run(run("direct"))
    shape = sorted((t.turn_index, t.prompt_tokens) for t in a.turns)
    assert shape == sorted((t.turn_index, t.prompt_tokens) for t in b.turns)
    assert sorted(t.prompt_tokens for t in a.turns if t.turn_index == 2) == [50 + 2 * (4 + 7)] * 3
    assert not {tuple(p[:50]) for p in pa} & {tuple(p[:50]) for p in pb}
