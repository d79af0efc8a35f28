"""Report helpers: the README's perf section is replaced between its markers only."""

from __future__ import annotations

from kvplane.bench.report import PERF_BEGIN, PERF_END, replace_between_markers


def test_markers_are_appended_when_absent() -> None:
    out = replace_between_markers("# readme\n", "table")
    assert out == f"# readme\n\n{PERF_BEGIN}\ntable\n{PERF_END}\n"


def test_only_the_text_between_markers_changes() -> None:
    text = f"head\n{PERF_BEGIN}\nold\n{PERF_END}\ntail\n"
    assert replace_between_markers(text, "new") == f"head\n{PERF_BEGIN}\nnew\n{PERF_END}\ntail\n"


def _row(name: str, p50: float, reused: float, **extra: object) -> dict[str, object]:
    row: dict[str, object] = {
        "name": name,
        "turns": 100,
        "ttft_ms": {"p50": p50, "p90": 2 * p50, "p99": 4 * p50, "mean": p50},
        "reused_fraction": reused,
        "reused_tokens": int(1000 * reused),
        "wrong_prefix_tokens": 0,
        "waited_turns": 0,
        "retained_gb_s": 1.0,
        "decisions": {},
    }
    row.update(extra)
    return row


def test_findings_say_where_kvplane_loses_and_why() -> None:
    from kvplane.bench.findings import findings

    rows = [
        _row("no-reuse", 400, 0.0),
        _row("vllm-proxy", 380, 0.13, wrong_prefix_tokens=5),
        _row("kvplane-ttl", 480, 0.12),
        _row("kvplane", 500, 0.05),
        _row("kvplane-fresh-loads", 370, 0.05),
        _row("oracle", 330, 0.35),
    ]
    text = "\n".join(findings({"mooncake": {"results": rows}}))
    assert "kvplane loses here" in text and "0.5 s old" in text
    assert "imported 5 tokens" in text
