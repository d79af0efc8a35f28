"""What one simulation run measured: raw per-turn series and the summary reported."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


class Recorder:
    """Per-turn samples and counters, filled by the event loop."""

    def __init__(self) -> None:
        self.ttft_s = array("d")
        # Per finished turn of more than one output token: seconds per output token after the
        # first (TPOT), prefills D ran on its own compute during the decode included.
        self.tpot_s = array("d")
        self.prompt_tokens = array("q")
        self.pulled_tokens = array("q")
        self.decisions: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        self.consumed = 0
        self.pulled_correct = 0  # pulled tokens whose prefix really matched
        self.cached_tokens = 0  # prompt tokens found in P's own prefix cache
        self.wrong_prefix_tokens = 0  # pulled tokens computed for other tokens
        self.wrong_prefix_turns = 0  # turns that imported any of those: their output is wrong
        self.reusable_tokens = 0  # whole-block tokens shared with the previous context
        self.prompt_total = 0
        self.overcommitted_turns = 0
        self.waited_turns = 0  # turns that waited for D's KV (pressure="wait")
        self.spilled_handles = 0  # retained handles copied to D's host tier instead of released
        self.host_pulled_tokens = 0  # of pulled_correct: read from D's host tier
        # Retained bytes integrated over time, and sampled for plots.
        self.retained_bytes = 0
        self.retained_byte_s = 0.0
        self.peak_retained_bytes = 0
        self._last_change_s = 0.0
        self.series_t = array("d")
        self.series_bytes = array("q")
        self.series_interval_s = 10.0
        self._next_sample_s = 0.0

    def retained_change(self, now: float, delta: int) -> None:
        self.retained_byte_s += self.retained_bytes * (now - self._last_change_s)
        self._last_change_s = now
        if now >= self._next_sample_s:
            self.series_t.append(now)
            self.series_bytes.append(self.retained_bytes)
            self._next_sample_s = now + self.series_interval_s
        self.retained_bytes += delta
        if self.retained_bytes > self.peak_retained_bytes:
            self.peak_retained_bytes = self.retained_bytes


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True, slots=True)
class SimSummary:
    """Headline figures of one run (ms, tokens, GB = 1e9 bytes)."""

    name: str
    turns: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    prompt_tokens: int
    # Prompt tokens not computed: pulled with a matching prefix, plus P's prefix-cache hits.
    reused_tokens: int
    reusable_tokens: int
    wrong_prefix_tokens: int
    retained_gb_s: float
    peak_retained_gb: float
    overcommitted_turns: int
    consumed_handles: int
    waited_turns: int = 0
    # Of reused_tokens: pulled from a decode node, and found in P's own cache.
    pulled_tokens: int = 0
    cached_tokens: int = 0
    wrong_prefix_turns: int = 0
    # The tiered engine model: handles spilled to D's host tier, and pulled tokens read from there.
    spilled_handles: int = 0
    host_pulled_tokens: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    releases: dict[str, int] = field(default_factory=dict)
    simulated_s: float = 0.0
    wall_s: float = 0.0
    # Time per output token after the first: longer where D carries more answers at once, and
    # where it runs prefills itself (each holds up every answer running there).
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan

    @property
    def reused_fraction(self) -> float:
        """Share of all prompt tokens not computed: correctly pulled or held by P."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def pulled_fraction(self) -> float:
        """Share of all prompt tokens pulled from a decode node with a matching prefix."""
        return self.pulled_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def waited_fraction(self) -> float:
        """Share of turns that waited for D's KV memory."""
        return self.waited_turns / self.turns if self.turns else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "turns": self.turns,
            "ttft_ms": {
                "p50": round(self.ttft_p50_ms, 1),
                "p90": round(self.ttft_p90_ms, 1),
                "p99": round(self.ttft_p99_ms, 1),
                "mean": round(self.ttft_mean_ms, 1),
            },
            "tpot_ms": {"p50": round(self.tpot_p50_ms, 2), "p99": round(self.tpot_p99_ms, 2)},
            "reused_token_fraction": round(self.reused_fraction, 4),
            "wrong_prefix_tokens": self.wrong_prefix_tokens,
            "wrong_prefix_turns": self.wrong_prefix_turns,
            "retained_gb_s": round(self.retained_gb_s, 1),
            "waited_turn_fraction": round(self.waited_fraction, 4),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "pulled_tokens": self.pulled_tokens,
            "cached_tokens": self.cached_tokens,
            "reusable_tokens": self.reusable_tokens,
            "peak_retained_gb": round(self.peak_retained_gb, 1),
            "overcommitted_turns": self.overcommitted_turns,
            "waited_turns": self.waited_turns,
            "consumed_handles": self.consumed_handles,
            "spilled_handles": self.spilled_handles,
            "host_pulled_tokens": self.host_pulled_tokens,
            "decisions": dict(sorted(self.decisions.items())),
            "releases": dict(sorted(self.releases.items())),
            "simulated_s": round(self.simulated_s, 1),
            "wall_s": round(self.wall_s, 2),
        }


@dataclass(frozen=True)
class SimResult:
    """A run's summary and its raw series (for plots)."""

    summary: SimSummary
    ttft_s: array[float]
    prompt_tokens: array[int]
    pulled_tokens: array[int]
    series_t: array[float]
    series_bytes: array[int]


def summarize(name: str, rec: Recorder, simulated_s: float, wall_s: float) -> SimResult:
    ttft = sorted(rec.ttft_s)
    tpot = sorted(rec.tpot_s)
    n = len(ttft)
    summary = SimSummary(
        name=name,
        turns=n,
        ttft_p50_ms=percentile(ttft, 50) * 1000.0,
        ttft_p90_ms=percentile(ttft, 90) * 1000.0,
        ttft_p99_ms=percentile(ttft, 99) * 1000.0,
        ttft_mean_ms=(sum(ttft) / n * 1000.0) if n else math.nan,
        prompt_tokens=rec.prompt_total,
        reused_tokens=rec.pulled_correct + rec.cached_tokens,
        reusable_tokens=rec.reusable_tokens,
        wrong_prefix_tokens=rec.wrong_prefix_tokens,
        retained_gb_s=rec.retained_byte_s / 1e9,
        peak_retained_gb=rec.peak_retained_bytes / 1e9,
        overcommitted_turns=rec.overcommitted_turns,
        consumed_handles=rec.consumed,
        waited_turns=rec.waited_turns,
        pulled_tokens=rec.pulled_correct,
        cached_tokens=rec.cached_tokens,
        wrong_prefix_turns=rec.wrong_prefix_turns,
        spilled_handles=rec.spilled_handles,
        host_pulled_tokens=rec.host_pulled_tokens,
        decisions=dict(rec.decisions),
        releases=dict(rec.releases),
        simulated_s=simulated_s,
        wall_s=wall_s,
        tpot_p50_ms=percentile(tpot, 50) * 1000.0,
        tpot_p99_ms=percentile(tpot, 99) * 1000.0,
    )
    return SimResult(
        summary, rec.ttft_s, rec.prompt_tokens, rec.pulled_tokens, rec.series_t, rec.series_bytes
    )
