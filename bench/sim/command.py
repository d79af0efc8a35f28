"""`kvplane sim`: replay a trace or a built-in workload through named policies, and compare them.

    kvplane sim --trace FILE.jsonl --policies no-reuse,vllm-proxy,kvplane \\
        --engine-model pinned --prefill 8 --decode 16 --kv-gib-per-decode 80 \\
        --p-cache-gib 64 --seed 1 --json out.json

`--trace` reads the Mooncake JSONL format (`timestamp` in ms, `input_length`,
`output_length`, `hash_ids`); `--workload agentic` takes the built-in
synthetic agentic workload instead. Each policy runs in its own process, as
many at a time as there are cores, over the same turns; results depend only
on the arguments. A progress bar is drawn on a terminal; the comparison
table is printed; `--json` writes each policy's figures.

`make bench` runs the same `run_policy` for every table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any, TextIO

from kvplane.bench.sim.baselines import BASELINES, Baseline, RunOptions, simulator_for
from kvplane.bench.sim.cluster import ClusterSpec
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.engine import ENGINE_MODELS, SimConfig
from kvplane.bench.sim.results import SimResult, SimSummary
from kvplane.bench.sim.retention import DEFAULT_DEMAND_LATENCY_S
from kvplane.bench.workloads import AgenticWorkload, TraceError, Turn, agentic_turns, mooncake_turns
from kvplane.services.routing.policy.config import load_policy
from kvplane.services.routing.policy.registry import PolicyConfigError

GIB = 1 << 30
WORKLOADS = ("agentic",)
# The built-in agentic workload: an hour of sessions starting at one a second.
AGENTIC_SESSIONS_PER_S = 1.0
AGENTIC_DURATION_S = 3600.0


@dataclass(frozen=True, slots=True)
class SimSpec:
    """One comparison: the turns, the fleet, the engine model (sizes in GiB, times in s)."""

    trace: str = ""
    workload: str = ""
    engine_model: str = "pinned"
    prefill: int = 8
    decode: int = 16
    kv_gib_per_decode: float = 80.0
    p_cache_gib: float = 64.0
    # Host memory for KV beside each D's accelerators (the tiered engine model only).
    host_gib_per_decode: float = 0.0
    # The what-if of `ClusterSpec.decode_write_through` (the tiered engine model only).
    host_write_through: bool = False
    # `ClusterSpec.decode_copy_ahead` (the tiered engine model only; false: the copy starts when
    # the blocks are wanted).
    host_copy_ahead: bool = True
    seed: int = 1
    # Seconds of simulated time between retention evaluations (the service's is at most 1 s).
    retention_interval_s: float = 1.0
    # Seconds from a decode node's KV demand to the release that answers it (report, leader, command, free).
    demand_latency_s: float = DEFAULT_DEMAND_LATENCY_S
    # The first this many turns only (0: all); for smoke runs.
    max_turns: int = 0
    # Multiplies every arrival time: 2 offers the same turns at half the rate.
    time_scale: float = 1.0
    # A routing policy file that kvplane's policies run in place of the packaged default (the
    # file an operator would give the routing service); empty: the default. The baselines'
    # own rules are theirs, and do not read it.
    routing_policy: str = ""

    def config(self) -> SimConfig:
        cluster = ClusterSpec(
            prefill_nodes=self.prefill,
            decode_nodes=self.decode,
            decode_kv_capacity_bytes=int(self.kv_gib_per_decode * GIB),
            prefill_cache_bytes=int(self.p_cache_gib * GIB),
            decode_host_bytes=int(self.host_gib_per_decode * GIB),
            decode_write_through=self.host_write_through,
            decode_copy_ahead=self.host_copy_ahead,
        )
        return SimConfig(cluster=cluster, pressure=ENGINE_MODELS[self.engine_model])

    def __post_init__(self) -> None:
        if (self.engine_model == "tiered") != (self.host_gib_per_decode > 0):
            raise ValueError(
                "the tiered engine model, and only it, needs host memory per decode node (> 0 GiB)"
            )
        if self.host_write_through and self.engine_model != "tiered":
            raise ValueError("write-through to host memory needs the tiered engine model")

    def policies(self) -> tuple[str, ...]:
        """Every baseline that this fleet can run (those that need D's host memory only with it)."""
        return tuple(n for n, b in BASELINES.items() if self.host_gib_per_decode > 0 or not b.needs_host_tier)

    def baseline(self, name: str) -> Baseline:
        """The named baseline as this spec runs it: kvplane's with the spec's routing policy."""
        baseline = BASELINES[name]
        if self.routing_policy and baseline.router == "policy":
            baseline = replace(baseline, routing_policy=self.routing_policy)
        return baseline

    def options(self) -> RunOptions:
        return RunOptions(
            retention_interval_s=self.retention_interval_s,
            seed=self.seed,
            demand_latency_s=self.demand_latency_s,
        )


@lru_cache(maxsize=4)
def load_turns(
    trace: str, workload: str, seed: int, max_turns: int, time_scale: float = 1.0
) -> tuple[Turn, ...]:
    """The spec's turns, once per process."""
    if trace:
        turns: Iterable[Turn] = mooncake_turns(trace, seed=seed)
    elif workload == "agentic":
        turns = agentic_turns(
            AgenticWorkload(seed=seed, sessions_per_s=AGENTIC_SESSIONS_PER_S, duration_s=AGENTIC_DURATION_S)
        )
    else:
        raise ValueError(f"no trace and no known workload (one of {', '.join(WORKLOADS)})")
    out = tuple(turns)
    if time_scale != 1.0:
        out = tuple(replace(t, arrival_s=t.arrival_s * time_scale) for t in out)
    return out[:max_turns] if max_turns > 0 else out


def spec_turns(spec: SimSpec) -> tuple[Turn, ...]:
    return load_turns(spec.trace, spec.workload, spec.seed, spec.max_turns, spec.time_scale)


def prefill_load(turns: Sequence[Turn], prefill_nodes: int, costs: SimCosts | None = None) -> float:
    """The prefill work the turns offer, as a fraction of what `prefill_nodes` can do over the
    turns' span, if nothing were reused: above 1, queues grow for as long as the load lasts,
    whatever the policy (reuse lowers it, by at most the share of tokens reused)."""
    if not turns or prefill_nodes <= 0:
        return 0.0
    costs = costs or SimCosts()
    span = max(t.arrival_s for t in turns) - min(t.arrival_s for t in turns)
    work = sum(costs.prefill_s(t.prompt_tokens) for t in turns)
    return work / (max(span, 1.0) * prefill_nodes)


def decode_memory_load(turns: Sequence[Turn], spec: SimSpec, costs: SimCosts | None = None) -> float:
    """The KV memory the turns' decoding holds on average (Little's law: each turn's prompt and
    output KV for its decode time), as a fraction of the decode nodes' KV; retained KV comes on
    top. Above 1, turns wait for decode memory for the whole run."""
    if not turns:
        return 0.0
    costs = costs or SimCosts()
    span = max(t.arrival_s for t in turns) - min(t.arrival_s for t in turns)
    step_s = costs.timing.decode_s(1)
    held = sum(
        (t.prompt_tokens + t.output_tokens) * costs.kv_bytes_per_token * t.output_tokens * step_s
        for t in turns
    )
    return held / (max(span, 1.0) * spec.decode * spec.kv_gib_per_decode * GIB)


def overload_warning(turns: Sequence[Turn], spec: SimSpec) -> str | None:
    """A warning when the fleet could not keep up with the turns: without reuse, P's work
    (a policy that reuses too little then falls behind, and its TTFTs measure the queue, not the
    policy), or D's memory for decoding alone."""
    memory = decode_memory_load(turns, spec)
    if memory > 1.0:
        return (
            f"warning: the turns' decoding alone needs {memory:.1f}x the KV memory of {spec.decode} D "
            f"({spec.kv_gib_per_decode:g} GiB each) on average: turns wait for decode memory for the "
            f"whole run; slow the arrivals with --time-scale {memory:.1f} or add --decode nodes"
        )
    load = prefill_load(turns, spec.prefill)
    if load <= 1.0:
        return None
    return (
        f"warning: without reuse the turns offer {load:.1f}x the prefill work {spec.prefill} P can do "
        f"over the trace's span: a policy that reuses less than {1 - 1 / load:.0%} of prompt tokens "
        f"falls behind for the whole run and its TTFTs measure the queue; slow the arrivals with "
        f"--time-scale {load:.1f} or add --prefill nodes"
    )


# Turns simulated so far by every worker, for the progress bar; set by `_init_worker`.
_COUNTER: Synchronized[int] | None = None
_COUNT_EVERY = 500


def _init_worker(counter: Synchronized[int] | None) -> None:
    global _COUNTER
    _COUNTER = counter


def _counted(turns: Iterable[Turn]) -> Iterator[Turn]:
    counter = _COUNTER
    if counter is None:
        yield from turns
        return
    n = 0
    for turn in turns:
        yield turn
        n += 1
        if n == _COUNT_EVERY:
            with counter.get_lock():
                counter.value += n
            n = 0
    with counter.get_lock():
        counter.value += n


def run_policy(spec: SimSpec, name: str) -> SimResult:
    """One named policy over the spec's turns and fleet."""
    sim = simulator_for(spec.baseline(name), spec.config(), spec.options())
    return sim.run(_counted(spec_turns(spec)), name)


def run_jobs(
    jobs: Sequence[tuple[SimSpec, str]], workers: int, progress: TextIO | None = None
) -> list[SimResult]:
    """Every (spec, policy) job, `workers` at a time; results in the jobs' order."""
    total = sum(len(spec_turns(spec)) for spec, _ in jobs)
    counter: Synchronized[int] = multiprocessing.Value("q", 0)
    bar = _Bar(progress, total) if progress is not None else None
    if workers <= 1:
        _init_worker(counter)
        try:
            out = []
            for spec, name in jobs:
                out.append(run_policy(spec, name))
                if bar is not None:
                    bar.draw(counter.value)
            return out
        finally:
            _init_worker(None)
            if bar is not None:
                bar.close()
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(counter,)) as pool:
        futures = [pool.submit(run_policy, spec, name) for spec, name in jobs]
        pending: set[Future[SimResult]] = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            if bar is not None:
                bar.draw(counter.value)
        if bar is not None:
            bar.close()
        return [f.result() for f in futures]


class _Bar:
    """A one-line progress bar over simulated turns, redrawn in place."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out = out
        self.total = max(1, total)
        self.started = time.monotonic()

    def draw(self, done: int) -> None:
        frac = min(1.0, done / self.total)
        filled = int(frac * 30)
        elapsed = time.monotonic() - self.started
        self.out.write(
            f"\r[{'#' * filled}{'.' * (30 - filled)}] {100 * frac:3.0f}%"
            f" {done:,}/{self.total:,} turns, {elapsed:.0f} s"
        )
        self.out.flush()

    def close(self) -> None:
        self.draw(self.total)
        self.out.write("\n")
        self.out.flush()


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def comparison_table(summaries: Sequence[SimSummary]) -> str:
    """The terminal's table: TTFT over all turns, TPOT, reuse, wrong-KV turns, waits, memory."""
    header = (
        "policy",
        "TTFT p50 ms",
        "p90 ms",
        "p99 ms",
        "TPOT p50/p99 ms",
        "reused",
        "wrong-prefix turns",
        "waited",
        "retained GB·s",
    )
    rows = [header]
    for s in summaries:
        rows.append(
            (
                s.name,
                f"{s.ttft_p50_ms:,.0f}",
                f"{s.ttft_p90_ms:,.0f}",
                f"{s.ttft_p99_ms:,.0f}",
                f"{s.tpot_p50_ms:.1f}/{s.tpot_p99_ms:.1f}",
                _pct(s.reused_fraction),
                f"{s.wrong_prefix_turns:,}",
                _pct(s.waited_fraction),
                f"{s.retained_gb_s:,.0f}",
            )
        )
    return aligned(rows)


def aligned(rows: Sequence[Sequence[str]]) -> str:
    """Rows as a terminal table: the first is the header; the first column left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def policy_json(summary: SimSummary) -> dict[str, Any]:
    """What `--json` writes per policy: the run's figures, without its wall time."""
    out = summary.as_dict()
    out.pop("wall_s", None)
    return out


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BASELINES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(BASELINES)}"
        )
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvplane sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="a Mooncake-format JSONL trace")
    source.add_argument("--workload", choices=WORKLOADS, help="a built-in synthetic workload")
    parser.add_argument(
        "--policies",
        type=_policies,
        help=f"comma-separated, from: {', '.join(BASELINES)} (default: all that the fleet can run;"
        " llm-d-p2p needs --engine-model tiered)",
    )
    parser.add_argument(
        "--engine-model",
        choices=tuple(ENGINE_MODELS),
        default="pinned",
        help="pinned: D keeps retained KV until read, released or expired, as vLLM does (default);"
        " evicting: a what-if engine that may drop retained KV under pressure;"
        " tiered: pinned, with host memory beside each D (--host-gib-per-decode): kvplane's D copies"
        " each handle there as it publishes it and moves it to that copy, freeing its accelerator"
        " blocks, when they are wanted (--no-host-copy-ahead: the copy starts only then)",
    )
    parser.add_argument(
        "--host-gib-per-decode",
        type=_non_negative,
        default=0.0,
        help="host memory for KV of each decode node, GiB (--engine-model tiered only; default 0)",
    )
    parser.add_argument(
        "--host-write-through",
        action="store_true",
        help="a what-if (--engine-model tiered only): kvplane's D copies each handle to host memory"
        " as it publishes it and frees the accelerator blocks once the copy is whole; no engine"
        " does this",
    )
    parser.add_argument(
        "--no-host-copy-ahead",
        dest="host_copy_ahead",
        action="store_false",
        help="(--engine-model tiered) kvplane's D copies a handle to host memory only when its"
        " accelerator blocks are wanted, and they wait for the copy; by default it copies each"
        " handle as it publishes it and moves it at once, as the sim-engine and vLLM's"
        " OffloadingConnector do",
    )
    parser.add_argument("--prefill", type=_positive_int, default=8, help="prefill nodes (default 8)")
    parser.add_argument("--decode", type=_positive_int, default=16, help="decode nodes (default 16)")
    parser.add_argument(
        "--kv-gib-per-decode",
        type=float,
        default=80.0,
        help="KV memory of each decode node, GiB (default 80)",
    )
    parser.add_argument(
        "--p-cache-gib",
        type=_non_negative,
        default=64.0,
        help="prefix cache of each prefill node, GiB (default 64; 0: none)",
    )
    parser.add_argument(
        "--demand-latency-s",
        type=_non_negative,
        default=DEFAULT_DEMAND_LATENCY_S,
        help="seconds from a decode node's KV demand to its freed blocks through kvplane"
        f" (default {DEFAULT_DEMAND_LATENCY_S})",
    )
    parser.add_argument(
        "--time-scale",
        type=_positive,
        default=1.0,
        help="multiply every arrival time by this: 2 offers the same turns at half the rate (default 1)",
    )
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the workload and of sampled routes (default 1)"
    )
    parser.add_argument(
        "--routing-policy",
        type=Path,
        help="a routing policy file (as the routing service takes, policy/config.py) that"
        " kvplane's policies run instead of the packaged default; the baselines' rules are"
        " their own",
    )
    parser.add_argument("--json", type=Path, help="write each policy's figures here")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="instead of one run per policy, find each policy's capacity at the SLO: the highest"
        " multiple of the workload's arrival rate at which its TTFT p99 stays within --slo-p99-ms",
    )
    parser.add_argument(
        "--slo-p99-ms", type=_positive, default=2000.0, help="the SLO of --goodput (default 2000)"
    )
    parser.add_argument(
        "--slo-tpot-p99-ms",
        type=_positive,
        help="with --goodput, a TPOT p99 bound (ms) each load must meet as well (goodput as DistServe"
        " defines it); default: TTFT alone (the TPOT p99 at each capacity is printed either way)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_gib_per_decode <= 0:
        parser.error("--kv-gib-per-decode must be > 0")
    if (args.engine_model == "tiered") != (args.host_gib_per_decode > 0):
        parser.error("--engine-model tiered needs --host-gib-per-decode > 0, and only it takes one")
    if args.host_write_through and args.engine_model != "tiered":
        parser.error("--host-write-through needs --engine-model tiered")
    if args.slo_tpot_p99_ms is not None and not args.goodput:
        parser.error("--slo-tpot-p99-ms needs --goodput")
    if args.routing_policy is not None:
        try:
            load_policy(args.routing_policy)
        except (OSError, PolicyConfigError) as e:
            parser.error(f"--routing-policy {args.routing_policy}: {e}")
    spec = SimSpec(
        trace=str(args.trace) if args.trace else "",
        workload=args.workload or "",
        engine_model=args.engine_model,
        prefill=args.prefill,
        decode=args.decode,
        kv_gib_per_decode=args.kv_gib_per_decode,
        p_cache_gib=args.p_cache_gib,
        host_gib_per_decode=args.host_gib_per_decode,
        host_write_through=args.host_write_through,
        host_copy_ahead=args.host_copy_ahead,
        seed=args.seed,
        demand_latency_s=args.demand_latency_s,
        time_scale=args.time_scale,
        routing_policy=str(args.routing_policy or ""),
    )
    try:
        turns = spec_turns(spec)
    except TraceError as e:
        print(f"kvplane sim: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kvplane sim: error: cannot read the trace: {e}", file=sys.stderr)
        return 2
    names: tuple[str, ...] = args.policies or spec.policies()
    if spec.host_gib_per_decode <= 0 and any(BASELINES[n].needs_host_tier for n in names):
        parser.error("llm-d-p2p needs --engine-model tiered (decode nodes with host memory)")
    source = spec.trace or f"the {spec.workload} workload"
    print(
        f"{len(turns):,} turns from {source}; {spec.prefill} P + {spec.decode} D,"
        f" {spec.kv_gib_per_decode:g} GiB KV per D, {spec.p_cache_gib:g} GiB prefix cache per P;"
        f" {spec.engine_model} engine model"
        + (f", {spec.host_gib_per_decode:g} GiB host memory per D" if spec.host_gib_per_decode else "")
        + (f"; kvplane's routing policy: {spec.routing_policy}" if spec.routing_policy else ""),
        flush=True,
    )
    warning = overload_warning(turns, spec)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if args.goodput:
        return _print_goodput(spec, names, args.slo_p99_ms, args.slo_tpot_p99_ms)
    workers = max(1, min(len(names), os.cpu_count() or 1))
    progress = sys.stderr if sys.stderr.isatty() else None
    results = run_jobs([(spec, n) for n in names], workers, progress)
    summaries = [r.summary for r in results]
    print(comparison_table(summaries))
    if args.json:
        data = {
            "spec": asdict(spec),
            "turns": len(turns),
            "policies": {s.name: policy_json(s) for s in summaries},
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _print_goodput(
    spec: SimSpec, names: Sequence[str], slo_p99_ms: float, slo_tpot_p99_ms: float | None
) -> int:
    from kvplane.bench.sim.goodput import CAPACITY_COLUMNS, find_goodput  # it builds on this module

    # Under a TPOT bound the load one step above may have missed on TPOT: its TPOT p99 is shown too.
    joint = slo_tpot_p99_ms is not None
    rows = [("policy", *CAPACITY_COLUMNS, *(("TPOT p99 ms one step more",) if joint else ()))]
    for name in names:
        g = find_goodput(spec, name, slo_p99_ms, slo_tpot_p99_ms=slo_tpot_p99_ms)
        above = "-" if math.isnan(g.missed_tpot_p99_ms) else f"{g.missed_tpot_p99_ms:.1f}"
        rows.append((name, *g.cells(), *((above,) if joint else ())))
    tpot = f" and TPOT p99 <= {slo_tpot_p99_ms:g} ms" if joint else ""
    print(f"capacity at TTFT p99 <= {slo_p99_ms:g} ms{tpot}")
    print(aligned(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
