"""The prefix-cache events benchmark runs its stages over a small stream and reports sane figures."""

from __future__ import annotations

from kvplane.bench.prefix_cache_events_bench import measure


def test_the_benchmark_reports_every_stage() -> None:
    figures = measure(events=400, blocks_per_event=8, replicas=2, window_ms=100.0, events_per_s=40.0)
    assert figures.subscriber_us_per_block > 0 and figures.routing_us_per_block > 0
    # Four events of 8 stored blocks per window (no evictions yet: the engine's cache is not full).
    assert figures.blocks_per_delta == 32
    assert figures.bytes_per_delta > 8 * figures.blocks_per_delta > figures.keepalive_bytes
    assert set(figures.score_ms_by_prompt_tokens) == {1024, 4096, 32768}
