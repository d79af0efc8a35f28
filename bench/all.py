"""`make bench`: the simulator benchmarks end to end, and the README's Performance section.

    python -m kvplane.bench.all [--out bench/results] [--quick] [--scale-turns N] [--micro]

1. The Mooncake trace's figures, measured by the adapter (shared/traces/README.md).
2. The whole trace replayed through every baseline on the headline fleet.
3. A sweep of decode KV capacity: reuse against retained GB·s per policy.
4. A synthetic agentic workload through every baseline.
5. Scale: 100 P + 100 D nodes and a million synthetic turns through kvplane.
6. With `--micro`: the control-plane microbenchmarks (they start their own etcd):
   `kvplane.bench.metadata_bench`, `route_bench`, `eviction_bench`, each as a subprocess.

Writes `results.json`, `tables.md` and PNG plots under `--out`, and rewrites
README.md between `<!-- perf:begin -->` and `<!-- perf:end -->`. Takes about a
quarter of an hour on two cores; `--quick` runs a small version in a minute.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvplane.bench import report
from kvplane.bench.findings import findings
from kvplane.bench.sim import BASELINES, ClusterSpec, RunOptions, SimConfig, SimResult, simulator_for
from kvplane.bench.workloads import (
    DEFAULT_TRACE,
    AgenticWorkload,
    Turn,
    agentic_turns,
    mooncake_turns,
    read_requests,
    trace_statistics,
)

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
# The headline fleet for the trace: 8 prefill and 16 decode nodes of 80 GiB KV each.
TRACE_CLUSTER = ClusterSpec(prefill_nodes=8, decode_nodes=16, decode_kv_capacity_bytes=80 * GIB)
SWEEP_CAPACITIES_GIB = (40, 80, 160, 320)
PINNED_POLICIES = ("no-reuse", "vllm-proxy", "kvplane-ttl", "kvplane", "kvplane-fresh-loads", "oracle")
SWEEP_POLICIES = ("vllm-proxy", "kvplane-ttl", "kvplane", "kvplane-long-ttl")
AGENTIC = AgenticWorkload(seed=7, sessions_per_s=1.0, duration_s=3600.0)
AGENTIC_CLUSTER = ClusterSpec(prefill_nodes=8, decode_nodes=16, decode_kv_capacity_bytes=80 * GIB)
SCALE_CLUSTER = ClusterSpec(prefill_nodes=100, decode_nodes=100, decode_kv_capacity_bytes=80 * GIB)
# At scale the policy sees the holder, the last P and 4 random nodes per role, and retention
# runs every 30 s of simulated time: see PolicyRouter and PipelineRetention.
SCALE_OPTIONS = RunOptions(route_candidates=4, retention_interval_s=30.0, seed=1)
# The headline replay evaluates retention every simulated second, as the service does at
# least; the sweep and the agentic runs every 5 s (max_age's margin is 30 s) to fit the budget.
HEADLINE = RunOptions(retention_interval_s=1.0)
COARSE = RunOptions(retention_interval_s=5.0)
MICROBENCHMARKS = ("metadata_bench", "route_bench", "eviction_bench")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_baselines(
    names: Iterable[str], turns: Sequence[Turn], config: SimConfig, options: RunOptions | None = None
) -> dict[str, SimResult]:
    out: dict[str, SimResult] = {}
    for name in names:
        result = simulator_for(BASELINES[name], config, options).run(turns, name)
        log(f"  {name}: {result.summary.turns} turns in {result.summary.wall_s:.1f} s")
        out[name] = result
    return out


def sweep(turns: Sequence[Turn], capacities: Sequence[int], policies: Sequence[str]) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    oracle = run_baselines(["oracle"], turns, SimConfig(cluster=TRACE_CLUSTER))["oracle"].summary
    for gib in capacities:
        config = SimConfig(cluster=replace(TRACE_CLUSTER, decode_kv_capacity_bytes=gib * GIB))
        for name, result in run_baselines(policies, turns, config, COARSE).items():
            s = result.summary
            points.append(
                {
                    "name": name,
                    "capacity_gib": gib,
                    "reused_fraction": s.reused_fraction,
                    "vs_oracle": s.reused_tokens / oracle.reused_tokens if oracle.reused_tokens else 0.0,
                    "retained_gb_s": s.retained_gb_s,
                    "ttft_p50_ms": s.ttft_p50_ms,
                    "ttft_p99_ms": s.ttft_p99_ms,
                }
            )
    return points


def run_scale(turns: int) -> dict[str, Any]:
    """kvplane's policies over 100 P + 100 D nodes and `turns` synthetic turns."""
    workload = AgenticWorkload(seed=11, sessions_per_s=10.0, duration_s=1e9, max_turns=turns)
    sim = simulator_for(BASELINES["kvplane"], SimConfig(cluster=SCALE_CLUSTER), SCALE_OPTIONS)
    scale = sim.run(agentic_turns(workload), "kvplane").summary
    return {
        "turns": scale.turns,
        "prefill_nodes": SCALE_CLUSTER.prefill_nodes,
        "decode_nodes": SCALE_CLUSTER.decode_nodes,
        "candidates_per_role": SCALE_OPTIONS.route_candidates,
        "retention_interval_s": SCALE_OPTIONS.retention_interval_s,
        "wall_s": scale.wall_s,
        "summary": scale.as_dict(),
    }


def run_micro(out: Path) -> dict[str, int]:
    """Runs each control-plane microbenchmark as a subprocess; its output goes to out/<name>.txt."""
    codes: dict[str, int] = {}
    for name in MICROBENCHMARKS:
        log(f"microbenchmark {name}")
        with (out / f"{name}.txt").open("w", encoding="utf-8") as sink:
            codes[name] = subprocess.run(
                [sys.executable, "-m", f"kvplane.bench.{name}"],
                stdout=sink,
                stderr=subprocess.STDOUT,
                check=False,
            ).returncode
    return codes


def perf_section(data: dict[str, Any], tables: str, plots_rel: str) -> str:
    trace = data["trace"]
    scale = data.get("scale")
    lines = [
        "## Performance",
        "",
        "Generated by `make bench` (`python -m kvplane.bench.all`): a discrete-event simulator"
        " (`kvplane.bench.sim`) that runs the routing and retention policies' own code in process over"
        " a simulated fleet, with costs fitted to published Qwen3-32B figures (prefill 158 ms at 2k"
        " tokens to 778 ms at 24k; pulls of 30-130 ms; 460 ms TTFT with a pulled 24k-token history;"
        " 256 KiB of KV per token). Every policy sees the same turns; `oracle` has unlimited KV and no"
        " TTL. These are simulated figures, not measurements of a live fleet.",
        "",
        f"Mooncake conversation trace: {trace['requests']:,} requests, {trace['continuations']:,} continue"
        f" an earlier context, gap p50 {trace['gap_p50_s']:.0f} s, {100 * trace['gaps_over_480s']:.1f}%"
        " of gaps over 480 s (the adapter reproduces `shared/traces/README.md`).",
        "",
        "Policies: `no-reuse` (round-robin, nothing retained); `vllm-proxy` (vLLM's example proxy:"
        " round-robin, one single-use handle per conversation kept 450 s, D's TTL 480 s, no prefix"
        " check, no release); `kvplane-ttl` (kvplane's routing policy, retention by age only);"
        " `kvplane` (the default routing and retention policies); `kvplane-long-ttl` (the same with D"
        " at a 1,800 s TTL); `kvplane-fresh-loads` (`kvplane` seeing current loads at every route, a"
        " what-if); `oracle` (unlimited KV, no TTL, pulls every shared prefix).",
        "",
        "What the numbers say:",
        "",
        *findings(data),
        "",
        tables,
        "",
        f"Plots: `{plots_rel}/` (TTFT against context length, TTFT CDF per policy, retained KV over"
        " time, reuse against retained GB·s).",
    ]
    if scale:
        s = scale["summary"]
        lines += [
            "",
            f"Scale: {scale['turns']:,} synthetic turns over {scale['prefill_nodes']} P + "
            f"{scale['decode_nodes']} D nodes through kvplane's policies in {scale['wall_s']:.0f} s"
            f" of wall time (one core; the policy sees the holder, the last prefill node and"
            f" {scale['candidates_per_role']} random nodes per role; retention every"
            f" {scale['retention_interval_s']:.0f} s). TTFT p50 {s['ttft_ms']['p50']:.0f} ms, p99"
            f" {s['ttft_ms']['p99']:.0f} ms; {100 * s['reused_fraction']:.1f}% of prompt tokens reused.",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help="a small version, for a smoke test")
    parser.add_argument("--scale-turns", type=int, default=1_000_000)
    parser.add_argument("--readme", type=Path, default=REPO / "README.md")
    parser.add_argument("--no-readme", action="store_true")
    parser.add_argument("--micro", action="store_true", help="also run the control-plane microbenchmarks")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {}

    # The scale run is the longest: it runs in a second process, on the second core, meanwhile.
    scale_turns = 20_000 if args.quick else args.scale_turns
    pool = ProcessPoolExecutor(max_workers=1)
    scale_future = pool.submit(run_scale, scale_turns) if scale_turns > 0 else None

    log("trace statistics")
    stats = trace_statistics(read_requests(args.trace))
    data["trace"] = {
        "requests": stats.requests,
        "continuations": stats.continuations,
        "resent_block_share": stats.resent_block_share,
        "gap_p50_s": stats.gap_quantiles_s.get(0.5, 0.0),
        "gap_quantiles_s": {str(q): v for q, v in stats.gap_quantiles_s.items()},
        "gaps_over_480s": stats.share_of_gaps_over(480.0),
    }

    turns = mooncake_turns(args.trace)
    if args.quick:
        turns = turns[:1500]
    names = list(BASELINES)
    log(f"Mooncake replay: {len(turns):,} turns, {len(names)} policies")
    trace_results = run_baselines(names, turns, SimConfig(cluster=TRACE_CLUSTER), HEADLINE)
    oracle = trace_results["oracle"].summary
    summaries = [r.summary for r in trace_results.values()]
    data["mooncake"] = {
        "cluster": {
            "prefill_nodes": TRACE_CLUSTER.prefill_nodes,
            "decode_nodes": TRACE_CLUSTER.decode_nodes,
            "decode_kv_gib": TRACE_CLUSTER.decode_kv_capacity_bytes // GIB,
        },
        "results": [s.as_dict() for s in summaries],
    }

    log("Mooncake replay with D pinning retained KV (vLLM's behaviour)")
    pinned_config = SimConfig(cluster=TRACE_CLUSTER, pressure="wait")
    pinned = run_baselines(PINNED_POLICIES, turns, pinned_config, COARSE)
    data["mooncake_pinned"] = {"results": [r.summary.as_dict() for r in pinned.values()]}

    log("capacity sweep")
    capacities = SWEEP_CAPACITIES_GIB[:2] if args.quick else SWEEP_CAPACITIES_GIB
    points = sweep(turns, capacities, SWEEP_POLICIES)
    data["sweep"] = points

    spec = replace(AGENTIC, duration_s=300.0) if args.quick else AGENTIC
    agentic = list(agentic_turns(spec))
    log(f"agentic workload: {len(agentic):,} turns")
    agentic_results = run_baselines(names, agentic, SimConfig(cluster=AGENTIC_CLUSTER), COARSE)
    agentic_oracle = agentic_results["oracle"].summary
    data["agentic"] = {"results": [r.summary.as_dict() for r in agentic_results.values()]}

    if scale_future is not None:
        log(f"waiting for the scale run ({scale_turns:,} turns)")
        data["scale"] = scale_future.result()
        log(f"  {data['scale']['turns']:,} turns in {data['scale']['wall_s']:.0f} s")
    pool.shutdown()

    if args.micro:
        data["micro"] = run_micro(out)

    log("reports")
    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    report.plot_ttft_vs_context(
        {k: trace_results[k] for k in ("no-reuse", "kvplane", "oracle")},
        plot_dir / "ttft_vs_context.png",
        "Mooncake trace: TTFT against prompt length",
    )
    report.plot_ttft_cdf(trace_results, plot_dir / "ttft_cdf.png", "Mooncake trace: TTFT CDF per policy")
    report.plot_retained(
        {k: v for k, v in trace_results.items() if k != "oracle"},
        plot_dir / "retained_memory.png",
        "Mooncake trace: retained KV over time",
    )
    report.plot_reuse_vs_retained(points, plot_dir / "reuse_vs_retained.png", "Reuse against retained KV")
    report.plot_ttft_cdf(agentic_results, plot_dir / "agentic_ttft_cdf.png", "Agentic workload: TTFT CDF")

    cluster = (
        f"{TRACE_CLUSTER.prefill_nodes} P + {TRACE_CLUSTER.decode_nodes} D,"
        f" {TRACE_CLUSTER.decode_kv_capacity_bytes // GIB} GiB of KV per D"
    )
    tables = "\n\n".join(
        [
            f"### Mooncake trace, whole ({len(turns):,} turns; {cluster})",
            report.headline_table(summaries, oracle),
            report.mix_table(summaries),
            "### Mooncake trace, D pins retained KV until read, released or expired (as vLLM does)",
            "Above, a decode node short of memory evicts its oldest retained handles for free. vLLM"
            " cannot: KV held for a remote read stays allocated, and new turns wait for memory. Same"
            " fleet, retention evaluated every 5 s:",
            report.pressure_table([r.summary for r in pinned.values()]),
            "### Decode KV capacity sweep (Mooncake trace)",
            report.sweep_table(points),
            f"### Synthetic agentic workload ({len(agentic):,} turns, seed {spec.seed}; same fleet)",
            report.headline_table([r.summary for r in agentic_results.values()], agentic_oracle),
            report.mix_table([r.summary for r in agentic_results.values()]),
        ]
    )
    data["wall_s"] = time.perf_counter() - started
    report.write_json(out / "results.json", data)
    (out / "tables.md").write_text(tables + "\n", encoding="utf-8")
    if not args.no_readme:
        plots_rel = str(plot_dir.relative_to(REPO)) if plot_dir.is_relative_to(REPO) else str(plot_dir)
        readme: Path = args.readme
        text = readme.read_text(encoding="utf-8")
        readme.write_text(
            report.replace_between_markers(text, perf_section(data, tables, plots_rel)), encoding="utf-8"
        )
    log(f"done in {data['wall_s']:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
