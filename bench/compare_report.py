"""The comparison's rows (one per front and concurrency), its printed tables and its JSON.

TTFT is the client's: from sending the turn (a zero-hop client: its P leg) to the first token.
It is reported for the turns that can reuse KV (turns 2 and later) and, apart, for first turns
(the same work on every front). Each front is paired with the zero-hop client that carries D's
handle (`zero-hop-reuse`) in the same run: the ratio of the two medians (and 99th
percentiles) over all repeats, and the lowest and highest ratio of single repeats.

Reuse is read from the prefill engines: of the prompt tokens of turns 2 and later, the share
pulled from D and the share found in P's own prefix cache (first turns are fresh token ids and
reuse nothing). `split` checks that the engines' pulled + cached + computed tokens equal the
prompt tokens the client sent in completed turns.

etcd's requests per turn are counted three ways, none flatter than the others claim:
- all of them over the front's blocks (`etcd_requests_per_turn`);
- above the idle window's rate (`..._above_idle`): the rate of a stack with no traffic at all;
- above the rate during the other fronts' blocks at the same concurrency (`..._above_others`):
  the same engines and services under the same load through a front that never uses etcd. That
  background holds the engines' lease keep-alives and heartbeats, and also the load reports
  their changing load causes, which kvplane's turns cause as much: this figure is what
  kvplane's turn path itself adds (check-outs, publishes, releases), not all it costs.
Beside them, the requests per turn by etcd method (`rpc:*`, all of them) and by what kvplane's
services sent each one for (`op:*`, all of them).

CPU per turn is charged to each front's own processes (kvplane: its gateway, its services, etcd;
a router or a proxy: its one process), all of it, and together also above the idle window's rate:
a control plane that keeps leases and load reports costs something per second whether turns come
or not, which at one conversation in flight is most of what a turn is charged.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvplane.bench.compare_fronts import KVPLANE_FRONTS, REFERENCE
from kvplane.bench.compare_metrics import (
    COMPUTED_ON,
    DEMAND_LE_1S,
    DEMAND_N,
    DEMAND_S,
    FREED,
    HOST_MOVED,
    HOST_READ,
    KV_WAIT_LE_1S,
    KV_WAIT_N,
    KV_WAIT_S,
    TTFT_N,
    TTFT_S,
)
from kvplane.bench.compare_run import BlockResult, IdleWindow, TurnRecord
from kvplane.bench.live import CACHED, COMPUTED, DECODE_CACHED, PULLED

CLIENT, ENGINES = "client", "engines"
ENGINE_PREFIX = "engine "


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the maximum for q=0.99 under 100 values); nan when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) and not math.isnan(b) else math.nan


@dataclass(frozen=True)
class Row:
    """One front at one concurrency, over every repeat."""

    front: str
    concurrency: int
    repeats: int
    turns_planned: int
    turns_ok: int
    failed: int
    fallback: int
    later_turns: int  # completed turns 2+ (the TTFT sample)
    ttft_p50_ms: float
    ttft_p99_ms: float
    first_turn_p50_ms: float
    p50_vs_reference: float
    p50_vs_reference_min: float
    p50_vs_reference_max: float
    p99_vs_reference: float
    p99_vs_reference_min: float
    p99_vs_reference_max: float
    turns_per_s: float
    later_prompt_tokens: int
    pulled_tokens: float
    prefix_cache_tokens: float
    computed_tokens: float
    split_adds_up: bool
    cpu_ms_per_turn: dict[str, float]
    etcd_requests_per_turn: float
    etcd_requests_per_turn_above_idle: float
    etcd_writes_per_turn: float
    etcd_writes_per_turn_above_idle: float
    route_ms: float  # kvplane's mean Route call, as its gateway timed it
    decisions: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Above the rate of the other fronts' blocks at this concurrency (nan: no such block).
    etcd_requests_per_turn_above_others: float = math.nan
    etcd_writes_per_turn_above_others: float = math.nan
    # All of the block's etcd requests per turn, by etcd method and by kvplane's operation.
    etcd_rpcs_per_turn: dict[str, float] = field(default_factory=dict)
    etcd_ops_per_turn: dict[str, float] = field(default_factory=dict)
    # Prompt tokens each prefill engine computed, in the engines' order.
    computed_by_prefill: list[float] = field(default_factory=list)
    # CPU per turn of the front's own processes together (kvplane: gateway, services, etcd), and
    # the same less what those processes spend with no traffic at all over as long (the idle
    # window's rate): the cost of a turn apart from the cost of being up.
    front_cpu_ms_per_turn: float = math.nan
    front_cpu_ms_per_turn_above_idle: float = math.nan
    # The engines' own TTFT, the mean over every request of the front's blocks (first turns
    # included): P's (its queue and prefill) and D's (its queue, the KV pull and its first step).
    # What the client's TTFT has beyond the two is the front's (and the network's).
    prefill_engine_ttft_ms: float = math.nan
    decode_engine_ttft_ms: float = math.nan
    # Prompt tokens of turns a decode engine served alone (prefill_on_decode) found in its own cache.
    decode_cache_tokens: float = 0.0
    # Time per output token after the first, over every completed turn's answer (first turns
    # included): what the decode engines' other work costs the answers being streamed.
    tpot_p50_ms: float = math.nan
    tpot_p99_ms: float = math.nan
    # Handles the decode engines moved to their host tier, and handles read from there.
    host_moved: float = 0.0
    host_read: float = 0.0
    # Decode handles the decode engines freed, by reason (read, early, ttl, host_full, ...).
    decode_frees: dict[str, float] = field(default_factory=dict)
    # kvplane's tokenizing of text prompts, as its gateway timed it: per turn, the mean call (nan:
    # none), and the share done in the gateway's own process (`gateway.tokenizers`; the rest asked
    # an engine's /tokenize).
    tokenize_per_turn: float = 0.0
    tokenize_ms: float = math.nan
    tokenize_local_share: float = 0.0
    # The eviction leader's answers to the decode nodes' KV demand in the front's blocks: how many,
    # the mean time to each (nan: none), and how many took longer than 1 s.
    demand_answers: float = 0.0
    demand_answer_ms: float = math.nan
    demand_answers_over_1s: float = 0.0
    # Requests on the decode engines that found too few free KV blocks: how many, their mean wait,
    # and how many waited over 1 s (sim-engines only).
    decode_kv_waits: float = 0.0
    decode_kv_wait_ms: float = math.nan
    decode_kv_waits_over_1s: float = 0.0
    # What the front itself added to the TTFT of later turns (compare_timeline.py): p50 and p99 of
    # its share, and the mean of each part (before the first leg, between legs, after the last
    # leg's first token), over the later turns whose legs were found (their count).
    front_share_p50_ms: float = math.nan
    front_share_p99_ms: float = math.nan
    # The rest of those turns' TTFT, the engines' time on their legs: p50 and p99.
    engines_share_p50_ms: float = math.nan
    engines_share_p99_ms: float = math.nan
    front_before_ms: float = math.nan
    front_between_ms: float = math.nan
    front_after_ms: float = math.nan
    front_share_turns: int = 0

    @property
    def prefill_spread(self) -> float:
        """The busiest prefill engine's computed tokens over the mean (1.0: evenly spread)."""
        tokens = self.computed_by_prefill
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        return max(tokens) / mean if mean > 0 else math.nan

    @property
    def pulled_share(self) -> float:
        return self.pulled_tokens / self.later_prompt_tokens if self.later_prompt_tokens else math.nan

    @property
    def prefix_cache_share(self) -> float:
        return self.prefix_cache_tokens / self.later_prompt_tokens if self.later_prompt_tokens else math.nan

    @property
    def decode_cache_share(self) -> float:
        return self.decode_cache_tokens / self.later_prompt_tokens if self.later_prompt_tokens else math.nan


def _later_ttft(turns: Sequence[TurnRecord]) -> list[float]:
    return [t.ttft_ms for t in turns if t.ok and t.turn > 0]


def _vs_reference(
    blocks: Sequence[BlockResult], reference: Sequence[BlockResult], q: float
) -> tuple[float, float, float]:
    """Pooled ratio of the q-th percentiles, then the lowest and highest ratio of one repeat."""
    mine = [x for b in blocks for x in _later_ttft(b.turns)]
    theirs = [x for b in reference for x in _later_ttft(b.turns)]
    pooled = _ratio(percentile(mine, q), percentile(theirs, q))
    ref_by_repeat = {b.repeat: b for b in reference}
    per_repeat = [
        _ratio(percentile(_later_ttft(b.turns), q), percentile(_later_ttft(ref_by_repeat[b.repeat].turns), q))
        for b in blocks
        if b.repeat in ref_by_repeat
    ]
    per_repeat = [r for r in per_repeat if not math.isnan(r)]
    return pooled, min(per_repeat, default=math.nan), max(per_repeat, default=math.nan)


def _etcd_rate(blocks: Sequence[BlockResult], key: str) -> float:
    """etcd's `key` per second over `blocks` (nan: none measured)."""
    seconds = sum(b.measured_s for b in blocks)
    return sum(b.etcd.get(key, 0.0) for b in blocks) / seconds if seconds > 0 else math.nan


def _per_turn(blocks: Sequence[BlockResult], prefix: str, turns: int) -> dict[str, float]:
    """The blocks' nonzero etcd counters named `prefix`*, per turn, prefix dropped."""
    total: Counter[str] = Counter()
    for b in blocks:
        total.update({k: v for k, v in b.etcd.items() if k.startswith(prefix)})
    return {k[len(prefix) :]: v / turns for k, v in sorted(total.items()) if v > 0}


def build_row(
    front: str,
    processes: Sequence[str],
    blocks: Sequence[BlockResult],
    reference: Sequence[BlockResult],
    idle: IdleWindow | None,
    background: Sequence[BlockResult] = (),
) -> Row:
    """The row of one front at one concurrency from its blocks (and the reference's).

    `background`: blocks of fronts that never use etcd, at the same concurrency, whose etcd
    rate is the background the `..._above_others` figures subtract."""
    turns = [t for b in blocks for t in b.turns]
    ok = [t for t in turns if t.ok]
    later = _later_ttft(turns)
    first = [t.ttft_ms for t in ok if t.turn == 0]
    n_ok = max(1, len(ok))
    sources: Counter[str] = Counter()
    for b in blocks:
        sources.update(b.sources)
    cpu: Counter[str] = Counter()
    for b in blocks:
        cpu.update(b.cpu_s)
    cpu_ms = {name: cpu[name] / n_ok * 1e3 for name in (*processes, CLIENT)}
    cpu_ms[ENGINES] = sum(v for k, v in cpu.items() if k.startswith(ENGINE_PREFIX)) / n_ok * 1e3
    measured = sum(b.measured_s for b in blocks)
    front_cpu_s = sum(cpu[name] for name in processes)
    idle_cpu_s = sum(idle.cpu_per_s(name) for name in processes) * measured if idle else math.nan
    requests = sum(b.etcd.get("requests", 0.0) for b in blocks)
    writes = sum(b.etcd.get("writes", 0.0) for b in blocks)
    idle_requests = idle.etcd_per_s("requests") * measured if idle else 0.0
    idle_writes = idle.etcd_per_s("writes") * measured if idle else 0.0
    route_s = sum(b.gateway.get("route_s", 0.0) for b in blocks)
    route_n = sum(b.gateway.get("route_n", 0.0) for b in blocks)
    tokenize_s = sum(b.gateway.get("tokenize_s", 0.0) for b in blocks)
    tokenize_n = sum(b.gateway.get("tokenize_n", 0.0) for b in blocks)
    tokenize_local_n = sum(b.gateway.get("tokenize_local_n", 0.0) for b in blocks)
    demand_n = sum(b.etcd.get(DEMAND_N, 0.0) for b in blocks)
    demand_s = sum(b.etcd.get(DEMAND_S, 0.0) for b in blocks)
    demand_within_1s = sum(b.etcd.get(DEMAND_LE_1S, 0.0) for b in blocks)
    waits = _engine_sum(blocks, KV_WAIT_N, "d")
    seen = sum(sources.get(source, 0.0) for source in (PULLED, CACHED, DECODE_CACHED, COMPUTED))
    decisions: Counter[str] = Counter()
    for b in blocks:
        decisions.update(b.decisions())
    p50 = _vs_reference(blocks, reference, 0.5)
    p99 = _vs_reference(blocks, reference, 0.99)
    tpot = [t.tpot_ms for t in ok if not math.isnan(t.tpot_ms)]
    shared = [t for t in ok if t.turn > 0 and not math.isnan(t.front_ms)]
    return Row(
        front=front,
        concurrency=blocks[0].concurrency if blocks else 0,
        repeats=len(blocks),
        turns_planned=len(turns),
        turns_ok=len(ok),
        failed=len(turns) - len(ok),
        fallback=decisions.get("fallback", 0),
        later_turns=len(later),
        ttft_p50_ms=percentile(later, 0.5),
        ttft_p99_ms=percentile(later, 0.99),
        first_turn_p50_ms=percentile(first, 0.5),
        p50_vs_reference=p50[0],
        p50_vs_reference_min=p50[1],
        p50_vs_reference_max=p50[2],
        p99_vs_reference=p99[0],
        p99_vs_reference_min=p99[1],
        p99_vs_reference_max=p99[2],
        turns_per_s=len(ok) / wall if (wall := sum(b.wall_s for b in blocks)) > 0 else math.nan,
        later_prompt_tokens=sum(t.prompt_tokens for t in ok if t.turn > 0),
        pulled_tokens=sources.get(PULLED, 0.0),
        prefix_cache_tokens=sources.get(CACHED, 0.0),
        computed_tokens=sources.get(COMPUTED, 0.0),
        decode_cache_tokens=sources.get(DECODE_CACHED, 0.0),
        split_adds_up=abs(seen - sum(t.prompt_tokens for t in ok)) < 0.5,
        cpu_ms_per_turn=cpu_ms,
        etcd_requests_per_turn=requests / n_ok,
        etcd_requests_per_turn_above_idle=(requests - idle_requests) / n_ok,
        etcd_writes_per_turn=writes / n_ok,
        etcd_writes_per_turn_above_idle=(writes - idle_writes) / n_ok,
        route_ms=route_s / route_n * 1e3 if route_n else math.nan,
        decisions=dict(decisions),
        errors=sorted({t.error for t in turns if t.error})[:5],
        etcd_requests_per_turn_above_others=(requests - _etcd_rate(background, "requests") * measured) / n_ok,
        etcd_writes_per_turn_above_others=(writes - _etcd_rate(background, "writes") * measured) / n_ok,
        etcd_rpcs_per_turn=_per_turn(blocks, "rpc:", n_ok),
        etcd_ops_per_turn=_per_turn(blocks, "op:", n_ok),
        computed_by_prefill=[sources[k] for k in sorted(filter(_is_engine_key, sources), key=_engine_index)],
        front_cpu_ms_per_turn=front_cpu_s / n_ok * 1e3,
        front_cpu_ms_per_turn_above_idle=(front_cpu_s - idle_cpu_s) / n_ok * 1e3,
        prefill_engine_ttft_ms=_engine_ttft_ms(blocks, "p"),
        decode_engine_ttft_ms=_engine_ttft_ms(blocks, "d"),
        tpot_p50_ms=percentile(tpot, 0.5) if tpot else math.nan,
        host_moved=sources.get(HOST_MOVED, 0.0),
        host_read=sources.get(HOST_READ, 0.0),
        decode_frees={k.removeprefix(FREED): v for k, v in sources.items() if k.startswith(FREED) and v},
        tpot_p99_ms=percentile(tpot, 0.99) if tpot else math.nan,
        tokenize_per_turn=tokenize_n / n_ok,
        tokenize_ms=tokenize_s / tokenize_n * 1e3 if tokenize_n else math.nan,
        tokenize_local_share=tokenize_local_n / tokenize_n if tokenize_n else 0.0,
        demand_answers=demand_n,
        demand_answer_ms=demand_s / demand_n * 1e3 if demand_n else math.nan,
        demand_answers_over_1s=demand_n - demand_within_1s,
        decode_kv_waits=waits,
        decode_kv_wait_ms=_engine_sum(blocks, KV_WAIT_S, "d") / waits * 1e3 if waits else math.nan,
        decode_kv_waits_over_1s=waits - _engine_sum(blocks, KV_WAIT_LE_1S, "d"),
        front_share_p50_ms=percentile([t.front_ms for t in shared], 0.5),
        front_share_p99_ms=percentile([t.front_ms for t in shared], 0.99),
        engines_share_p50_ms=percentile([t.ttft_ms - t.front_ms for t in shared], 0.5),
        engines_share_p99_ms=percentile([t.ttft_ms - t.front_ms for t in shared], 0.99),
        front_before_ms=_mean([t.front_before_ms for t in shared]),
        front_between_ms=_mean([t.front_between_ms for t in shared]),
        front_after_ms=_mean([t.front_after_ms for t in shared]),
        front_share_turns=len(shared),
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _engine_sum(blocks: Sequence[BlockResult], key: str, role: str) -> float:
    """`key`'s counter summed over the engines whose names start with `role`, over the blocks."""
    return sum(v for b in blocks for k, v in b.engines.items() if k.startswith(key + role))


def _engine_ttft_ms(blocks: Sequence[BlockResult], role: str) -> float:
    """The mean TTFT of the engines whose names start with `role` over the blocks (nan: none)."""
    count = _engine_sum(blocks, TTFT_N, role)
    return _engine_sum(blocks, TTFT_S, role) / count * 1e3 if count else math.nan


def _is_engine_key(key: str) -> bool:
    return key.startswith(COMPUTED_ON)


def _engine_index(key: str) -> int:
    return int(key.removeprefix(COMPUTED_ON))


def rows(
    blocks: Sequence[BlockResult],
    processes: Mapping[str, Sequence[str]],
    idle: IdleWindow | None,
) -> list[Row]:
    """Every (front, concurrency) that ran, fronts in `processes`' order, lowest concurrency first."""
    out = []
    for concurrency in sorted({b.concurrency for b in blocks}):
        at = [b for b in blocks if b.concurrency == concurrency]
        reference = [b for b in at if b.front == REFERENCE]
        for front, names in processes.items():
            mine = sorted((b for b in at if b.front == front), key=lambda b: b.repeat)
            # kvplane's fronts are the ones that use etcd: the others' blocks are the background.
            background = [b for b in at if b.front != front and b.front not in KVPLANE_FRONTS]
            if mine:
                out.append(build_row(front, names, mine, reference, idle, background))
    return out


# -- printing ---------------------------------------------------------------------------


def _f(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def _x(value: float, low: float, high: float) -> str:
    if math.isnan(value):
        return "-"
    spread = "" if math.isnan(low) else f" [{low:.2f}-{high:.2f}]"
    return f"{value:.2f}x{spread}"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1%}"


def latency_table(table: Sequence[Row]) -> str:
    lines = [
        "| front | conc | turns ok/planned | failed | fallback | TTFT p50 ms (t2+) | p99 ms "
        "| p50 vs zero-hop-reuse [per-repeat range] | p99 vs zero-hop-reuse | turn-1 TTFT p50 ms "
        "| turns/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r.front} | {r.concurrency} | {r.turns_ok}/{r.turns_planned} | {r.failed} | {r.fallback} "
            f"| {_f(r.ttft_p50_ms)} | {_f(r.ttft_p99_ms)} "
            f"| {_x(r.p50_vs_reference, r.p50_vs_reference_min, r.p50_vs_reference_max)} "
            f"| {_x(r.p99_vs_reference, r.p99_vs_reference_min, r.p99_vs_reference_max)} "
            f"| {_f(r.first_turn_p50_ms)} | {_f(r.turns_per_s, 2)} |"
        )
    return "\n".join(lines)


def engine_ttft_table(table: Sequence[Row]) -> str:
    """Where a later turn's TTFT goes: the client's p50 beside the engines' own mean TTFTs and
    the front's own share of each turn (its p50 and p99, and the mean of its parts: before the
    first leg, between the legs, after D's first token) and the engines' share (the rest of the
    turn's TTFT: the engines' time on its legs); and the answers' time per output token
    after the first (TPOT), which work a front puts on D (a prefill there) takes from the answers
    D is streaming."""
    lines = [
        "| front | conc | TTFT p50 ms (t2+) | P's own TTFT, mean ms | D's own TTFT, mean ms "
        "| front's share p50 / p99 ms | its parts, mean ms: before / between / after "
        "| engines' share p50 / p99 ms | TPOT p50 ms | TPOT p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r.front} | {r.concurrency} | {_f(r.ttft_p50_ms)} | {_f(r.prefill_engine_ttft_ms)} "
            f"| {_f(r.decode_engine_ttft_ms)} | {_f(r.front_share_p50_ms)} / {_f(r.front_share_p99_ms)} "
            f"| {_f(r.front_before_ms)} / {_f(r.front_between_ms)} / {_f(r.front_after_ms)} "
            f"| {_f(r.engines_share_p50_ms)} / {_f(r.engines_share_p99_ms)} "
            f"| {_f(r.tpot_p50_ms, 2)} | {_f(r.tpot_p99_ms, 2)} |"
        )
    return "\n".join(lines)


def cost_table(table: Sequence[Row]) -> str:
    lines = [
        "| front | conc | t2+ tokens reused: pulled from D | from P's prefix cache | D's own cache "
        "| split adds up "
        "| CPU ms/turn, front's processes | together (above idle) | client | engines "
        "| etcd req/turn (above idle) [above other fronts] "
        "| etcd writes/turn (above idle) [above other fronts] | Route ms (tokenize ms) "
        "| busiest P's computed tokens vs the mean |",
        "|---|---:|---:|---:|---:|:-:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        own = ", ".join(
            f"{name} {ms:.2f}" for name, ms in r.cpu_ms_per_turn.items() if name not in (CLIENT, ENGINES)
        )
        lines.append(
            f"| {r.front} | {r.concurrency} | {_pct(r.pulled_share)} | {_pct(r.prefix_cache_share)} "
            f"| {_pct(r.decode_cache_share)} | {'yes' if r.split_adds_up else 'NO'} | {own or 'none'} "
            f"| {_f(r.front_cpu_ms_per_turn)} ({_f(r.front_cpu_ms_per_turn_above_idle)}) "
            f"| {r.cpu_ms_per_turn.get(CLIENT, math.nan):.2f} "
            f"| {r.cpu_ms_per_turn.get(ENGINES, math.nan):.2f} "
            f"| {_f(r.etcd_requests_per_turn)} ({_f(r.etcd_requests_per_turn_above_idle)}) "
            f"[{_f(r.etcd_requests_per_turn_above_others)}] "
            f"| {_f(r.etcd_writes_per_turn)} ({_f(r.etcd_writes_per_turn_above_idle)}) "
            f"[{_f(r.etcd_writes_per_turn_above_others)}] "
            f"| {_legs(r) if r.front in KVPLANE_FRONTS else '-'} | {_f(r.prefill_spread, 2)} |"
        )
    return "\n".join(lines)


def _legs(row: Row) -> str:
    """kvplane's Route, and its tokenizing where it tokenized (marked `local` where the gateway did
    it all in its own process)."""
    route = _f(row.route_ms, 2)
    if not row.tokenize_per_turn:
        return route
    where = " local" if row.tokenize_local_share == 1.0 else ""
    return f"{route} ({_f(row.tokenize_ms, 2)}{where})"


def idle_line(idle: IdleWindow) -> str:
    per_engine_s = idle.etcd_per_s("writes") / max(1, idle.engines)
    named = [name for name in idle.cpu_s if not name.startswith(ENGINE_PREFIX)]
    cpu = ", ".join(f"{name} {idle.cpu_per_s(name) * 1e3:.1f}" for name in named)
    return (
        f"idle ({idle.seconds:.1f} s, no traffic): etcd {idle.etcd_per_s('requests'):.1f} requests/s, "
        f"{idle.etcd_per_s('writes'):.1f} writes/s = {per_engine_s:.2f} writes per engine-second "
        f"({idle.engines} engines); CPU ms/s: {cpu}"
    )


def etcd_lines(table: Sequence[Row]) -> list[str]:
    """kvplane's etcd requests per turn, by etcd method and by what its services sent them for."""
    out = []
    for r in table:
        if r.front in KVPLANE_FRONTS and (r.etcd_rpcs_per_turn or r.etcd_ops_per_turn):
            rpcs = ", ".join(f"{k} {v:.2f}" for k, v in r.etcd_rpcs_per_turn.items())
            ops = ", ".join(f"{k} {v:.2f}" for k, v in r.etcd_ops_per_turn.items())
            out.append(f"{r.front} c={r.concurrency} etcd requests/turn by method: {rpcs or '-'}")
            out.append(f"{r.front} c={r.concurrency} etcd requests/turn by operation: {ops or '-'}")
    return out


def decisions_line(table: Sequence[Row]) -> str:
    parts = []
    for r in table:
        if r.front in KVPLANE_FRONTS and r.decisions:
            mix = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items()))
            parts.append(f"{r.front} c={r.concurrency}: {mix}")
    return "kvplane decisions: " + "; ".join(parts) if parts else ""


def host_tier_line(table: Sequence[Row]) -> str:
    parts = [
        f"{r.front} c={r.concurrency}: {r.host_moved:.0f} moved, {r.host_read:.0f} read from there"
        for r in table
        if r.host_moved or r.host_read
    ]
    return "decode host tier: " + "; ".join(parts) if parts else ""


def _timed_line(title: str, table: Sequence[Row], timed: Callable[[Row], tuple[float, float, float]]) -> str:
    """`title`: per row that had any, how many, their mean ms and how many took over 1 s (`timed`)."""
    parts = []
    for r in table:
        count, mean_ms, over_1s = timed(r)
        if count:
            parts.append(
                f"{r.front} c={r.concurrency}: {count:.0f} (mean {_f(mean_ms)} ms, {over_1s:.0f} over 1 s)"
            )
    return f"{title}: " + "; ".join(parts) if parts else ""


def demand_line(table: Sequence[Row]) -> str:
    """The eviction leader's answers to KV demand, per row that had any."""
    return _timed_line(
        "KV demand answered by the eviction leader",
        table,
        lambda r: (r.demand_answers, r.demand_answer_ms, r.demand_answers_over_1s),
    )


def kv_wait_line(table: Sequence[Row]) -> str:
    """The decode engines' requests that waited for free KV blocks, per row that had any."""
    return _timed_line(
        "decode requests that waited for KV blocks",
        table,
        lambda r: (r.decode_kv_waits, r.decode_kv_wait_ms, r.decode_kv_waits_over_1s),
    )


def decode_frees_line(table: Sequence[Row]) -> str:
    parts = []
    for r in table:
        if r.decode_frees:
            reasons = ", ".join(f"{k} {n:.0f}" for k, n in sorted(r.decode_frees.items()))
            parts.append(f"{r.front} c={r.concurrency}: {reasons}")
    return "decode handles freed, by reason: " + "; ".join(parts) if parts else ""


def render(title: str, table: Sequence[Row], idle: IdleWindow | None) -> str:
    out = [f"## {title}", "", latency_table(table), "", engine_ttft_table(table), "", cost_table(table), ""]
    if idle is not None:
        out.append(idle_line(idle))
    out += etcd_lines(table)
    if line := decisions_line(table):
        out.append(line)
    for line in (host_tier_line(table), demand_line(table), kv_wait_line(table), decode_frees_line(table)):
        if line:
            out.append(line)
    for r in table:
        if r.errors:
            out.append(f"{r.front} c={r.concurrency} errors: {'; '.join(r.errors)}")
    return "\n".join(out)


def _clean(value: Any) -> Any:
    """JSON without NaN (null instead)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def row_json(row: Row) -> dict[str, Any]:
    out = asdict(row)
    out["pulled_share"] = row.pulled_share
    out["prefix_cache_share"] = row.prefix_cache_share
    out["decode_cache_share"] = row.decode_cache_share
    return dict(_clean(out))


def dump(path: str, document: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(_clean(dict(document)), f, indent=1)


def ttft_summary(turns: Sequence[TurnRecord]) -> str:
    """One line of a block's progress: turns and TTFT of later turns."""
    later = _later_ttft(turns)
    ok = sum(t.ok for t in turns)
    med = statistics.median(later) if later else math.nan
    return f"{ok}/{len(turns)} turns, TTFT p50 (t2+) {_f(med)} ms"
