"""Report helpers: the README's perf section is replaced between its markers only."""

from __future__ import annotations

from kvplane.bench.report import PERF_BEGIN, PERF_END, replace_between_markers


def test_markers_are_appended_when_absent() -> None:
    out = replace_between_markers("# readme\n", "table")
    assert out == f"# readme\n\n{PERF_BEGIN}\ntable\n{PERF_END}\n"


def test_only_the_text_between_markers_changes() -> None:
    text = f"head\n{PERF_BEGIN}\nold\n{PERF_END}\ntail\n"
    assert replace_between_markers(text, "new") == f"head\n{PERF_BEGIN}\nnew\n{PERF_END}\ntail\n"
