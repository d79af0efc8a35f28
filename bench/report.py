"""Benchmark reports: JSON for machines, Markdown tables for people, PNG plots.

Plots need matplotlib (the `bench` extra); it is imported only when a plot
is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplane.bench.sim.results import SimResult, SimSummary, percentile

PERF_BEGIN = "<!-- perf:begin -->"
PERF_END = "<!-- perf:end -->"

# Prompt-length bins (tokens) for TTFT against context length.
CONTEXT_BINS: tuple[int, ...] = (0, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 1 << 40)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _mix(counts: Mapping[str, int], total: int) -> str:
    if not total:
        return ""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {100.0 * v / total:.0f}%" for k, v in top if v)


def comparison_table(summaries: Sequence[SimSummary]) -> str:
    """One row per policy: TTFT over all turns, TPOT, reuse by source, wrong-KV turns, waits,
    memory."""
    rows = [
        "| policy | TTFT p50 ms | p90 ms | p99 ms | TPOT p50 / p99 ms | not recomputed | pulled from D"
        " | P cache | wrong-prefix turns | waited for D's KV | retained GB·s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        prompt = s.prompt_tokens or 1
        rows.append(
            f"| {s.name} | {s.ttft_p50_ms:,.0f} | {s.ttft_p90_ms:,.0f} | {s.ttft_p99_ms:,.0f}"
            f" | {s.tpot_p50_ms:.1f} / {s.tpot_p99_ms:.1f}"
            f" | {_pct(s.reused_fraction)} | {_pct(s.pulled_tokens / prompt)}"
            f" | {_pct(s.cached_tokens / prompt)}"
            f" | {s.wrong_prefix_turns:,} | {_pct(s.waited_fraction)} | {s.retained_gb_s:,.0f} |"
        )
    return "\n".join(rows)


def mix_table(summaries: Sequence[SimSummary]) -> str:
    """Decision mix and releases by reason, per baseline."""
    rows = ["| policy | decisions | releases |", "|---|---|---|"]
    for s in summaries:
        releases = sum(s.releases.values())
        rel = ", ".join(f"{k} {v:,}" for k, v in sorted(s.releases.items(), key=lambda kv: -kv[1])) or "-"
        rows.append(f"| {s.name} | {_mix(s.decisions, s.turns)} | {rel} ({releases:,}) |")
    return "\n".join(rows)


def ttft_by_context(result: SimResult, pulled: bool | None = None) -> list[tuple[int, float, int]]:
    """(bin upper bound, median TTFT ms, turns) per prompt-length bin; `pulled` filters turns."""
    bins: list[list[float]] = [[] for _ in CONTEXT_BINS[1:]]
    for ttft, prompt, got in zip(result.ttft_s, result.prompt_tokens, result.pulled_tokens, strict=True):
        if pulled is not None and (got > 0) != pulled:
            continue
        for i, hi in enumerate(CONTEXT_BINS[1:]):
            if prompt < hi:
                bins[i].append(ttft)
                break
    out = []
    for hi, values in zip(CONTEXT_BINS[1:], bins, strict=True):
        if values:
            values.sort()
            out.append((hi, percentile(values, 50) * 1000.0, len(values)))
    return out


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_vs_context(results: Mapping[str, SimResult], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"<{hi // 1000}k" if hi < 1 << 39 else ">64k" for hi in CONTEXT_BINS[1:]]
    for name, result in results.items():
        series: list[tuple[str, bool | None]] = [(name, None)]
        if any(result.pulled_tokens):
            series = [(f"{name}: pulled", True), (f"{name}: recomputed", False)]
        for label, pulled in series:
            points = ttft_by_context(result, pulled)
            index = {hi: i for i, hi in enumerate(CONTEXT_BINS[1:])}
            ax.plot([index[hi] for hi, _, _ in points], [ms for _, ms, _ in points], marker="o", label=label)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft_cdf(results: Mapping[str, SimResult], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in results.items():
        values = sorted(v * 1000.0 for v in result.ttft_s)
        n = len(values)
        if not n:
            continue
        step = max(1, n // 2000)  # a few thousand points draw the same curve
        xs = values[::step]
        ys = [(i * step + 1) / n for i in range(len(xs))]
        ax.plot(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("share of turns")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_retained(results: Mapping[str, SimResult], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, result in results.items():
        if not any(result.series_bytes):
            continue
        ax.plot(list(result.series_t), [b / 1e9 for b in result.series_bytes], label=name)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("retained KV (GB)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replace_between_markers(text: str, body: str) -> str:
    """`text` with what lies between the perf markers replaced (markers appended if absent)."""
    start = text.find(PERF_BEGIN)
    end = text.find(PERF_END)
    if start < 0 or end < start:
        return text.rstrip("\n") + f"\n\n{PERF_BEGIN}\n{body.strip()}\n{PERF_END}\n"
    return text[: start + len(PERF_BEGIN)] + "\n" + body.strip() + "\n" + text[end:]


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
