"""The live benchmark's report: TTFT by decision, the decision mix, and the control plane's cost."""

from __future__ import annotations

from kvplane.bench.live import LiveResult, TurnResult, report


def test_report_compares_first_turns_with_the_direct_baseline_and_splits_by_decision() -> None:
    result = LiveResult(
        turns=[
            TurnResult("c0", 0, 4000, 100, "direct", 300.0, "direct"),
            TurnResult("c0", 0, 4000, 100, "recompute_no_handle", 320.0, "gateway"),
            TurnResult("c0", 1, 4300, 100, "pull", 200.0, "gateway"),
            TurnResult("c0", 2, 4600, 100, "recompute_cost", 330.0, "gateway"),
        ],
        pulled_tokens=4099,
        prompt_tokens_on_prefill=16900,
    )
    text = report(result)
    assert "| gateway, later turns: pull | 1 | 200.0 |" in text
    assert "| direct to engines (turn 1) | 1 | 300.0 |" in text
    assert "+20.0 ms" in text
    assert "recompute_no_handle 33%" in text and "pull 33%" in text
    assert "24.3%" in text
    assert result.decision_shares() == {"recompute_no_handle": 1 / 3, "pull": 1 / 3, "recompute_cost": 1 / 3}
