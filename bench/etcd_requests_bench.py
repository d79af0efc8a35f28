"""etcd requests per turn and per idle engine, measured on the dev stack.

    python -m kvplane.bench.etcd_requests_bench [--conversations 24] [--turns 4] [--idle-s 20]

Starts the dev stack (etcd, `serve all`, one prefill and one decode sim-engine,
the gateway; P without a prefix cache, so that later turns pull), lets it sit
idle for `--idle-s`, then runs multi-turn conversations through the gateway,
and reads two sets of counters before and after each window:

- etcd's own (`/metrics`): gRPC requests handled by method (Range, Txn, Put,
  DeleteRange, LeaseGrant, LeaseRevoke; LeaseKeepAlive by messages received),
  raft proposals committed (every write, lease grants and revokes included;
  reads and keep-alives are not proposals), and the MVCC put, delete and range
  counts (ops inside transactions included);
- `serve all`'s `kvplane_etcd_request_seconds_count` by operation: which code
  path sent each request (the only etcd client of the stack).

Printed: per turn, the requests of the run window less the idle rate over the
same time (so load reports that turns trigger count against the turns), by etcd
method and by kvplane operation; per engine-second while idle, the same.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from kvplane.bench.live import token_chat
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import run_until_stopped, stopped

MODEL = DEMO_MODEL
# etcd's gRPC methods that are one request each (LeaseKeepAlive is counted by messages).
UNARY_METHODS = ("Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseRevoke")
# kvplane operations each engine causes whether or not turns run: its load reports and the
# keep-alives of its lease (with the read of its registration that each did before).
ENGINE_OPS = frozenset({"report_load", "get_node", "node_keepalive"})
# The control plane's own background, whatever the number of engines: sweeps, the election.
CONTROL_PLANE_OPS = frozenset(
    {"lease_keepalive", "claims_scan", "orphan_scan", "list_nodes", "election_leader", "campaign", "revision"}
)
BACKGROUND_OPS = ENGINE_OPS | CONTROL_PLANE_OPS | {"read_range"}
# kvplane operations that write (raft proposals); the others read or renew a lease.
WRITE_OPS = frozenset(
    {
        "report_load",
        "register_node",
        "publish",
        "check_out",
        "release_freed",
        "release_freed_claims",
        "freed_tombstones",
        "claim_consumed",
        "drop_indexed",
        "ack_release",
        "release",
        "release_unused_claim",
        "lease_grant",
        "lease_revoke",
        "mark_suspect",
        "campaign",
    }
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format: (name, labels, value) for every sample."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match.group(3) or ""))
        out.append((match.group(1), labels, float(match.group(4))))
    return out


@dataclass(frozen=True)
class Sample:
    """Counters at one moment: etcd's by kind, kvplane's by operation."""

    at: float
    etcd: Mapping[str, float]
    ops: Mapping[str, float]

    def minus(self, other: Sample) -> tuple[float, dict[str, float], dict[str, float]]:
        etcd = {k: v - other.etcd.get(k, 0.0) for k, v in self.etcd.items()}
        ops = {k: v - other.ops.get(k, 0.0) for k, v in self.ops.items()}
        return self.at - other.at, etcd, ops


def etcd_counters(text: str) -> dict[str, float]:
    out: defaultdict[str, float] = defaultdict(float)
    for name, labels, value in parse_metrics(text):
        method = labels.get("grpc_method", "")
        if name == "grpc_server_handled_total" and method in UNARY_METHODS:
            out[method] += value
        elif name == "grpc_server_msg_received_total" and method == "LeaseKeepAlive":
            out["LeaseKeepAlive"] += value
        elif name == "etcd_server_proposals_committed_total":
            out["writes (raft proposals)"] += value
        elif name.startswith("etcd_debugging_mvcc_") and name.endswith("_total"):
            kind = name.removeprefix("etcd_debugging_mvcc_").removesuffix("_total")
            if kind in ("put", "delete", "txn", "range"):
                out[f"mvcc {kind}"] += value
    return dict(out)


def op_counters(text: str) -> dict[str, float]:
    out: defaultdict[str, float] = defaultdict(float)
    for name, labels, value in parse_metrics(text):
        if name == "kvplane_etcd_request_seconds_count":
            out[labels.get("op", "?")] += value
    return dict(out)


async def sample(session: aiohttp.ClientSession, etcd_url: str, metrics_url: str) -> Sample:
    async with session.get(f"{etcd_url}/metrics") as resp:
        etcd = etcd_counters(await resp.text())
    async with session.get(metrics_url) as resp:
        ops = op_counters(await resp.text())
    return Sample(time.monotonic(), etcd, ops)


def requests_of(etcd: Mapping[str, float]) -> float:
    return sum(etcd.get(m, 0.0) for m in (*UNARY_METHODS, "LeaseKeepAlive"))


async def conversation(
    session: aiohttp.ClientSession, url: str, api_key: str, seed: int, args: argparse.Namespace
) -> Counter[str]:
    headers = {"authorization": f"Bearer {api_key}", "x-conversation-id": f"etcd-bench-{seed}"}
    decisions: Counter[str] = Counter()
    async for decision, _, _ in token_chat(
        session,
        url,
        headers,
        seed=seed,
        turns=args.turns,
        prompt_tokens=args.prompt_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        model=MODEL,
    ):
        decisions[decision or "-"] += 1
    return decisions


async def settled(
    session: aiohttp.ClientSession, etcd_url: str, metrics_url: str, quiet_s: float, timeout_s: float
) -> Sample:
    """A sample once the turn path's operations have stopped moving for `quiet_s`
    (publishes and release reports trail the last answer)."""
    last = await sample(session, etcd_url, metrics_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet_s)  # one quiet period between samples
        now = await sample(session, etcd_url, metrics_url)
        moved = any(
            now.ops.get(op, 0.0) != last.ops.get(op, 0.0)
            for op in set(now.ops) | set(last.ops)
            if op not in BACKGROUND_OPS
        )
        if not moved:
            return now
        last = now
    return last


@dataclass(frozen=True)
class Result:
    engines: int
    turns: int
    decisions: Counter[str]
    idle_s: float
    idle_etcd: Mapping[str, float]
    idle_ops: Mapping[str, float]
    run_s: float
    run_etcd: Mapping[str, float]
    run_ops: Mapping[str, float]

    def idle_rate(self, counts: Mapping[str, float], key: str) -> float:
        return counts.get(key, 0.0) / self.idle_s if self.idle_s > 0 else 0.0

    def per_turn(self, run: Mapping[str, float], idle: Mapping[str, float], key: str) -> float:
        """The run's count less the idle rate over the run's duration, per turn."""
        return (run.get(key, 0.0) - self.idle_rate(idle, key) * self.run_s) / max(1, self.turns)


async def run(args: argparse.Namespace) -> Result:
    from kvplane.services.devstack.stack import DEMO_API_KEY, start_stack

    stack = await start_stack(
        progress=lambda m: print(f"==> {m}", file=sys.stderr, flush=True),
        # Without P's prefix cache every later turn pulls its history from D: a check-out per turn.
        prefill_prefix_caching=args.prefill_prefix_cache,
    )
    etcd_url = stack.etcd.client_url
    engines = len(stack.prefill_urls) + len(stack.decode_urls)
    url = f"{stack.gateway_url}/v1/completions"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            # One unmeasured conversation: connections, leases and code paths warmed up.
            await conversation(session, url, DEMO_API_KEY, 10**6, args)
            await settled(session, etcd_url, stack.metrics_url, 1.0, 30.0)
            print(f"==> idle for {args.idle_s:.0f} s", file=sys.stderr, flush=True)
            idle_start = await sample(session, etcd_url, stack.metrics_url)
            await asyncio.sleep(args.idle_s)  # the idle window
            idle_end = await sample(session, etcd_url, stack.metrics_url)
            print(f"==> {args.conversations} conversations x {args.turns} turns", file=sys.stderr)
            queue = iter(range(args.conversations))
            decisions: Counter[str] = Counter()

            async def worker() -> None:
                for seed in queue:
                    decisions.update(await conversation(session, url, DEMO_API_KEY, seed, args))

            run_start = await sample(session, etcd_url, stack.metrics_url)
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            run_end = await settled(session, etcd_url, stack.metrics_url, 1.0, 30.0)
    finally:
        stack.stop()
    idle_s, idle_etcd, idle_ops = idle_end.minus(idle_start)
    run_s, run_etcd, run_ops = run_end.minus(run_start)
    return Result(
        engines,
        args.conversations * args.turns,
        decisions,
        idle_s,
        idle_etcd,
        idle_ops,
        run_s,
        run_etcd,
        run_ops,
    )


def report(r: Result, args: argparse.Namespace) -> str:
    lines = [
        f"{r.turns} turns ({args.conversations} conversations x {args.turns}, concurrency"
        f" {args.concurrency}) in {r.run_s:.1f} s; idle window {r.idle_s:.1f} s; {r.engines} engines",
        "decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())),
        "",
        f"{'etcd (server side)':<28}{'per turn':>10}{'idle /engine-s':>16}",
    ]
    keys = [*UNARY_METHODS, "LeaseKeepAlive"]
    rows = [(k, k) for k in keys] + [
        ("requests (all above)", ""),
        ("writes (raft proposals)", "writes (raft proposals)"),
        ("mvcc put", "mvcc put"),
        ("mvcc delete", "mvcc delete"),
        ("mvcc txn", "mvcc txn"),
        ("mvcc range", "mvcc range"),
    ]
    for label, key in rows:
        if key:
            turn = r.per_turn(r.run_etcd, r.idle_etcd, key)
            idle = r.idle_rate(r.idle_etcd, key) / r.engines
        else:
            turn = sum(r.per_turn(r.run_etcd, r.idle_etcd, k) for k in keys)
            idle = requests_of(r.idle_etcd) / r.idle_s / r.engines
        lines.append(f"{label:<28}{turn:>10.2f}{idle:>16.3f}")
    lines += ["", f"{'kvplane operation':<28}{'per turn':>10}{'idle /s':>16}"]
    ops = sorted(set(r.run_ops) | set(r.idle_ops))
    for op in ops:
        turn = r.per_turn(r.run_ops, r.idle_ops, op)
        idle = r.idle_rate(r.idle_ops, op)
        if abs(turn) < 0.005 and idle < 0.0005:
            continue
        lines.append(f"{op:<28}{turn:>10.2f}{idle:>16.3f}")
    turn_ops = [op for op in ops if op not in BACKGROUND_OPS]
    turn_requests = sum(r.run_ops.get(op, 0.0) for op in turn_ops) / max(1, r.turns)
    lines.append(f"{'turn path (no load, no sweeps)':<28}{turn_requests:>10.2f}")
    per_turn = sum(r.per_turn(r.run_etcd, r.idle_etcd, k) for k in keys)
    # Idle, at 1,000 engines: what each engine causes, times 1,000, and the control plane's own.
    engine_requests = sum(r.idle_rate(r.idle_ops, op) for op in ENGINE_OPS) / r.engines
    engine_writes = sum(r.idle_rate(r.idle_ops, op) for op in ENGINE_OPS & WRITE_OPS) / r.engines
    own = sum(r.idle_rate(r.idle_ops, op) for op in CONTROL_PLANE_OPS)
    load_per_turn = r.per_turn(r.run_ops, r.idle_ops, "report_load")
    lines += [
        "",
        f"idle, per engine: {engine_requests:.3f} etcd requests/s, of which {engine_writes:.3f} writes/s"
        f" (load reports and lease keep-alives); the control plane's own background {own:.2f} requests/s",
        f"at 1,000 idle engines: {engine_requests * 1000:,.0f} requests/s,"
        f" {engine_writes * 1000:,.0f} writes/s, plus the control plane's {own:.1f}",
        f"load reports the turns set off: {load_per_turn:.2f} per turn at this rate"
        f" ({r.turns / r.run_s:.1f} turns/s on {r.engines} engines)",
        f"turns/s one etcd cluster carries at 30,000 requests/s: {30_000 / max(per_turn, 1e-9):,.0f}"
        f" (all requests per turn, {per_turn:.2f}); {30_000 / max(turn_requests, 1e-9):,.0f}"
        f" on the turn path alone ({turn_requests:.2f})",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="etcd_requests_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=24, help="conversations")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--prompt-tokens", type=int, default=8000, help="first prompt, tokens")
    parser.add_argument("--user-tokens", type=int, default=64, help="new user tokens in each later turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn")
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    parser.add_argument(
        "--prefill-prefix-cache",
        action="store_true",
        help="keep P's prefix cache on (later turns then mostly recompute what P holds, no check-out)",
    )
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle window, seconds")
    args = parser.parse_args(argv)
    results = run_until_stopped(run(args))
    if results is None:
        return stopped()
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
