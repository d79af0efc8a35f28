"""Route latency, throughput and CPU cost, beside a bare gRPC echo in the same run.

    python -m kvplane.bench.route_bench [--calls-c1 1000] [--calls-c64 3000] [--tracing off|on|both]

Starts its own etcd, one routing replica and one echo server, each in its own
process, registers 4 prefill and 4 decode nodes, and drives them from this
process at concurrency 1 and 64:

- echo:      a unary call that returns the RouteRequest's bytes, no
             interceptors: the floor of one gRPC round trip of that size;
- etcd txn:  the pull's check-out transaction alone (compare, two deletes,
             two puts, a 2 KiB claim) from a bare client: the floor of what
             a pull adds to a recompute;
- recompute: first turns (no handle): view lookup and policy only;
- pull:      second turns of conversations with a retained handle: policy,
             prefix check of the prompt's token ids, and the check-out
             transaction in etcd;
- seen:      the steady state of multi-turn traffic: a later turn of a
             conversation whose two previous prompts this replica routed
             (each the history less one or two 96-token answers), with a
             retained handle of the whole history. The prompt's digest chain
             continues the previous prompt's (the phase runs first, while
             the replica's prompt cache still holds those prompts; later
             phases' prompts would push them out), and the policy decides as it
             would (pull, or recompute on the prefill node that holds the
             earlier prompt): the decisions are printed under the table.

The routing replica runs once with tracing off (sampling 0) and once with
tracing on (every span recorded, batched and encoded as OTLP protobuf, then
discarded: the serialization cost is counted, the network is not).

CPU per call is the CPU time used during the phase by every process involved
(this client, the server, and etcd for routing), read from /proc, divided by
the calls made. Targets: Route p50 <= 2x echo p50, and <= 1.5 ms of
CPU per Route across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.processes import run_until_stopped, stopped

HISTORY_TOKENS = 4096
NEW_TOKENS = 64
# The answer each earlier turn of a "seen" conversation added to its history, tokens.
ANSWER_TOKENS = 96
BLOCK = 16
MODEL = "bench-model"
# Callers identify as a mesh proxy would (the cheapest of the authenticators to check).
MESH_SECRET = "route-bench-secret"
_ECHO_METHOD = "/kvplane.bench.Echo/Echo"


def _clock_ticks() -> int:
    return os.sysconf(os.sysconf_names["SC_CLK_TCK"])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all threads), from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 14 and 15 (utime, stime) are the 12th and 13th after the command.
    return (int(fields[11]) + int(fields[12])) / _clock_ticks()


def history(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(HISTORY_TOKENS)]


# -- servers (run as subprocesses) -------------------------------------------------


async def _serve_echo(port: int) -> None:
    def echo(request: bytes, context: object) -> bytes:
        return request

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "kvplane.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await _until_signalled()
    await server.stop(0.2)


async def _serve_routing(port: int, etcd: str, prefix: str, tracing: bool) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from kvplane.services.common.runtime.telemetry import Telemetry
    from kvplane.services.process import ServiceProcess
    from kvplane.services.routing.app import install
    from kvplane.services.settings import KvplaneSettings

    class EncodeAndDiscard(SpanExporter):
        """Pays an OTLP exporter's encoding cost, sends nothing."""

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    settings = KvplaneSettings.model_validate(
        {
            "grpc": {"listen": f"127.0.0.1:{port}", "grace_s": 0.2},
            "etcd": {"endpoints": [etcd], "prefix": prefix},
            "telemetry": {"metrics_port": 0, "sample_ratio": 1.0 if tracing else 0.0},
            # The benchmark routes as a tenant calling Route itself.
            "auth": {
                "mode": "mesh",
                "mesh_experimental": True,
                "mesh": {"secrets": [MESH_SECRET]},
                "tenants_see_engines": True,
            },
        }
    )
    telemetry = (
        Telemetry.create("routing", sample_ratio=1.0, exporter=EncodeAndDiscard())
        if tracing
        else Telemetry.create("routing", sample_ratio=0.0)
    )
    process = ServiceProcess(settings, [install], telemetry)
    await process.start()
    await _until_signalled()
    await process.stop()


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()


def _spawn(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane.bench.route_bench", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"server {args[0]} did not start: {line!r}")
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    name: str
    concurrency: int
    calls: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_call: float
    # CPU per call of each process measured, in the order given (client first).
    cpu_split_ms: tuple[float, ...] = ()
    # Routing decisions made in the phase, by name (only where they vary).
    decisions: tuple[tuple[str, int], ...] = ()

    @property
    def rate(self) -> float:
        return self.calls / self.seconds


async def drive(
    name: str,
    concurrency: int,
    calls: int,
    call: Callable[[int], Awaitable[None]],
    pids: Sequence[int],
) -> Result:
    """Runs `calls` calls, `concurrency` at a time; call(i) gets a unique index."""
    latencies: list[float] = []
    counter = iter(range(calls))

    async def worker() -> None:
        for i in counter:
            start = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - start)

    cpu_before = [cpu_seconds(p) for p in pids]
    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    split = [cpu_seconds(p) - before for p, before in zip(pids, cpu_before, strict=True)]
    cpu = sum(split)
    latencies.sort()
    return Result(
        name,
        concurrency,
        calls,
        elapsed,
        statistics.median(latencies) * 1000,
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
        cpu / calls * 1000,
        tuple(c / calls * 1000 for c in split),
    )


async def register_nodes(etcd: str, prefix: str) -> list[Any]:
    from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
    from kvplane.services.common.store import Store, StoreSettings

    store = Store(StoreSettings(endpoints=(etcd,), prefix=prefix, request_timeout_s=10.0))
    await store.connect()
    nodes = []
    for role, tag in ((NodeRole.PREFILL, "p"), (NodeRole.DECODE, "d")):
        for i in range(4):
            node = Node(
                node_id=f"{tag}{i}",
                incarnation=uuid.uuid4().hex,
                role=role,
                engine_id=f"engine-{tag}{i}",
                http_url=f"http://127.0.0.{i + 1}:8000",
                side_channel_host=f"127.0.0.{i + 1}",
                side_channel_port=5600,
                fingerprint=Fingerprint(MODEL, "bfloat16", "NHD"),
                block_size=BLOCK,
                kv_capacity_bytes=1 << 34,
                kv_bytes_per_token=4096,
            )
            await store.register_node(node, 300)
            await store.report_load(
                NodeLoad(
                    node.node_id,
                    node.incarnation,
                    running_requests=i,
                    free_kv_blocks=50_000,
                    total_kv_blocks=100_000,
                    reported_unix_ms=int(time.time() * 1000),
                )
            )
            nodes.append(node)
    await store.close()
    return nodes


async def report_loads(etcd: str, prefix: str, nodes: Sequence[Any], interval_s: float = 1.0) -> None:
    """Reports every node's load each `interval_s`, as node agents do, until cancelled."""
    from kvplane.services.common.model.errors import StoreUnavailable
    from kvplane.services.common.model.nodes import NodeLoad
    from kvplane.services.common.store import Store, StoreSettings

    store = Store(StoreSettings(endpoints=(etcd,), prefix=prefix, request_timeout_s=10.0))
    await store.connect()
    try:
        while True:
            for i, node in enumerate(nodes):
                # A slow etcd under the benchmark's load must not end the reports.
                with contextlib.suppress(StoreUnavailable):
                    await store.report_load(
                        NodeLoad(
                            node.node_id,
                            node.incarnation,
                            running_requests=i % 4,
                            free_kv_blocks=50_000,
                            total_kv_blocks=100_000,
                            reported_unix_ms=int(time.time() * 1000),
                        )
                    )
            await asyncio.sleep(interval_s)  # the agents' report period
    finally:
        await store.close()


async def publish_handles(
    etcd: str, prefix: str, holders: Sequence[object], conversations: Sequence[str]
) -> None:
    from kvplane.connector.digests import digest_tokens
    from kvplane.services.common.model.errors import StoreUnavailable
    from kvplane.services.common.model.handles import CacheHandle, VllmHandle
    from kvplane.services.common.model.nodes import Node
    from kvplane.services.common.store import Store, StoreSettings

    store = Store(StoreSettings(endpoints=(etcd,), prefix=prefix, request_timeout_s=10.0))
    await store.connect()
    sem = asyncio.Semaphore(8)

    async def one(i: int, conversation: str) -> None:
        holder = holders[i % len(holders)]
        assert isinstance(holder, Node)
        # Every conversation shares one history: the prompts then cost the client nothing to build.
        tokens = history(0)
        vllm = VllmHandle(
            remote_engine_id=holder.engine_id,
            remote_request_id=f"req-{conversation}",
            remote_block_ids=(tuple(range(HISTORY_TOKENS // BLOCK)),),
            remote_num_tokens=HISTORY_TOKENS,
            remote_host=holder.side_channel_host,
            remote_port=holder.side_channel_port,
            remote_blocks_expiry_time=1000.0,
        )
        handle = CacheHandle(
            handle_id=f"h-{conversation}",
            tenant="bench",
            conversation=conversation,
            holder_node_id=holder.node_id,
            holder_incarnation=holder.incarnation,
            vllm=vllm,
            wall_expiry_unix_ms=int(time.time() * 1000) + 600_000,
            retained_bytes=HISTORY_TOKENS * 4096,
            digests=digest_tokens(tokens, BLOCK),
            model=MODEL,
        )
        async with sem:
            for attempt in range(5):
                try:
                    await store.publish_handle(handle)
                    return
                except StoreUnavailable:
                    # On a busy machine etcd can stall for seconds; the publish is idempotent.
                    if attempt == 4:
                        raise

    await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations)))
    await store.close()


async def bare_txns(etcd: LocalEtcd, prefix: str, concurrency: int, calls: int) -> Result:
    """The check-out's etcd transaction alone, from a bare client: the same compare and four
    writes (a 2 KiB claim), nothing else. What a pull route adds to a recompute cannot be less."""
    from aetcd import rpc

    from kvplane.services.common.store import fencing

    assert etcd.proc is not None
    base = f"{prefix}txn/{uuid.uuid4().hex[:6]}/".encode()
    claim = bytes(2048)
    async with grpc.aio.insecure_channel(etcd.endpoint.removeprefix("http://")) as channel:
        kv = rpc.KVStub(channel)
        revisions = []
        for i in range(calls):
            put = await kv.Put(rpc.PutRequest(key=base + b"h/%d" % i, value=b"handle"), timeout=10)
            revisions.append(put.header.revision)

        async def checkout(i: int) -> None:
            key = base + b"h/%d" % i
            request = rpc.TxnRequest(
                compare=[fencing.same_revision(key, revisions[i])],
                success=[
                    fencing.delete(key),
                    fencing.delete(base + b"i/%d" % i),
                    fencing.put(base + b"c/%d" % i, claim),
                    fencing.put(base + b"x/%d" % i, base + b"c/%d" % i),
                ],
            )
            if not (await kv.Txn(request, timeout=10)).succeeded:
                raise RuntimeError("bare check-out transaction failed its compare")

        return await drive("etcd txn", concurrency, calls, checkout, [os.getpid(), etcd.proc.pid])


async def run(
    calls_c1: int, calls_c64: int, tracing_rounds: Sequence[bool] = (False, True)
) -> list[tuple[str, Result]]:
    from kvplane.v1 import routing_pb2

    etcd = LocalEtcd()
    etcd.start()
    assert etcd.proc is not None
    results: list[tuple[str, Result]] = []
    echo_port = free_port()
    echo = _spawn("serve-echo", str(echo_port))
    me = os.getpid()
    try:
        prefix = f"/bench/{uuid.uuid4().hex}/"
        nodes = await register_nodes(etcd.endpoint, prefix)
        holders = [n for n in nodes if getattr(n, "node_id", "").startswith("d")]
        new = list(range(7, 7 + NEW_TOKENS))
        prompt = [*history(0), *new]

        # The echo request is the Route request itself, so both move the same bytes.
        sample = routing_pb2.RouteRequest(
            conversation="c", model=MODEL, prompt_token_ids=prompt
        ).SerializeToString()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as channel:
            echo_call: Any = channel.unary_unary(_ECHO_METHOD)

            async def do_echo(i: int) -> None:
                await echo_call(sample, timeout=10)

            small = routing_pb2.RouteRequest(
                conversation="c", model=MODEL, prompt_tokens=4160
            ).SerializeToString()

            async def do_echo_small(i: int) -> None:
                await echo_call(small, timeout=10)

            await drive("warm", 4, 200, do_echo, [me])
            for conc, calls in ((1, calls_c1), (64, calls_c64)):
                results.append(("", await drive("echo", conc, calls, do_echo, [me, echo.pid])))
            for conc, calls in ((1, calls_c1), (64, calls_c64)):
                results.append(("", await drive("echo small", conc, calls, do_echo_small, [me, echo.pid])))

        for conc, calls in ((1, calls_c1), (64, calls_c64)):
            results.append(("", await bare_txns(etcd, prefix, conc, calls)))

        reporter = asyncio.create_task(report_loads(etcd.endpoint, prefix, nodes))
        try:
            for tracing in tracing_rounds:
                results += await routing_round(tracing, etcd, prefix, holders, prompt, calls_c1, calls_c64)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
    finally:
        _stop(echo)
        etcd.cleanup()
    return results


async def routing_round(
    tracing: bool,
    etcd: LocalEtcd,
    prefix: str,
    holders: Sequence[Any],
    prompt: Sequence[int],
    calls_c1: int,
    calls_c64: int,
) -> list[tuple[str, Result]]:
    """Recompute and pull phases against a fresh routing replica."""
    from kvplane.services.client import RoutingClient

    assert etcd.proc is not None
    me = os.getpid()
    results: list[tuple[str, Result]] = []
    port = free_port()
    server = _spawn("serve-routing", str(port), etcd.endpoint, prefix, "on" if tracing else "off")
    tag = "tracing on" if tracing else "tracing off"
    try:
        round_id = uuid.uuid4().hex[:6]
        # Handles for two pull phases (with and without token ids) and the seen phase, then one sentinel.
        per_phase = calls_c1 + calls_c64
        conversations = [f"pull-{round_id}-{i}" for i in range(2 * per_phase)]
        seen = [f"seen-{round_id}-{i}" for i in range(per_phase)]
        async with RoutingClient(
            [f"127.0.0.1:{port}"],
            metadata=(("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-tenant", "bench")),
            timeout_s=10.0,
        ) as client:
            # The seen conversations' two earlier turns, routed before their handle exists.
            history_tokens = list(prompt[:HISTORY_TOKENS])
            for earlier in (2, 1):
                turn = history_tokens[: HISTORY_TOKENS - earlier * ANSWER_TOKENS]

                async def do_earlier(i: int, turn: list[int] = turn) -> None:
                    await client.route(seen[i], MODEL, prompt_token_ids=turn)

                await drive("warm", 64, len(seen), do_earlier, [me])
            conversations += [*seen, f"pull-{round_id}-last"]
            await publish_handles(etcd.endpoint, prefix, holders, conversations)
            # The last handle published is in the view once it pulls: so are all others.
            deadline = time.monotonic() + 30
            while True:
                r = await client.route(conversations[-1], MODEL, prompt_tokens=HISTORY_TOKENS + NEW_TOKENS)
                if r.decision == "pull":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"handles never reached the view: {r.decision} {r.reason}")
                await asyncio.sleep(0.1)  # waiting for the watch to deliver the publishes

            async def do_recompute(i: int) -> None:
                await client.route(f"first-{round_id}-{i}", MODEL, prompt_token_ids=prompt)

            pulls = 0
            offset = 0

            async def do_pull(i: int) -> None:
                nonlocal pulls
                r = await client.route(conversations[offset + i], MODEL, prompt_token_ids=prompt)
                pulls += r.decision == "pull"

            async def do_pull_length_only(i: int) -> None:
                nonlocal pulls
                r = await client.route(
                    conversations[offset + i], MODEL, prompt_tokens=HISTORY_TOKENS + NEW_TOKENS
                )
                pulls += r.decision == "pull"

            async def do_length_only(i: int) -> None:
                await client.route(f"len-{round_id}-{i}", MODEL, prompt_tokens=len(prompt))

            decided: Counter[str] = Counter()
            seen_offset = 0

            async def do_seen(i: int) -> None:
                r = await client.route(seen[seen_offset + i], MODEL, prompt_token_ids=prompt)
                decided[r.decision] += 1

            pids = [me, server.pid, etcd.proc.pid]
            # First, while the replica's prompt cache (16 Mi tokens) still holds every seen
            # conversation's last prompt: the later phases' prompts would push them out.
            for conc, calls in ((1, calls_c1), (64, calls_c64)):
                decided.clear()
                res = await drive("route seen", conc, calls, do_seen, pids)
                results.append((tag, replace(res, decisions=tuple(sorted(decided.items())))))
                seen_offset += calls
            await drive("warm", 4, 200, do_recompute, [me])
            for conc, calls in ((1, calls_c1), (64, calls_c64)):
                results.append((tag, await drive("route len-only", conc, calls, do_length_only, pids)))
            for conc, calls in ((1, calls_c1), (64, calls_c64)):
                results.append((tag, await drive("route recompute", conc, calls, do_recompute, pids)))
            for name, call in (("route pull len-only", do_pull_length_only), ("route pull", do_pull)):
                for conc, calls in ((1, calls_c1), (64, calls_c64)):
                    pulls = 0
                    res = await drive(name, conc, calls, call, pids)
                    if pulls != calls:
                        raise RuntimeError(f"only {pulls} of {calls} {name} routes pulled")
                    results.append((tag, res))
                    offset += calls
    finally:
        _stop(server)
    return results


def report(results: list[tuple[str, Result]]) -> str:
    # Each Route row is compared with the echo that moves a request of its size:
    # "echo" carries the same token ids, "echo small" a length-only request.
    echo = {(r.name, r.concurrency): r for _, r in results if r.name.startswith("echo")}
    lines = [
        f"{'call':<21}{'tracing':<13}{'conc':>5}{'calls':>7}{'p50 ms':>9}{'p99 ms':>9}{'calls/s':>9}"
        f"{'CPU ms/call':>13}{'(client/server/etcd)':>23}{'p50/echo':>10}",
    ]
    for tag, r in results:
        base = "echo small" if r.name.endswith("len-only") or r.name == "etcd txn" else "echo"
        ratio = r.p50_ms / echo[(base, r.concurrency)].p50_ms if not r.name.startswith("echo") else 1.0
        split = "/".join(f"{c:.2f}" for c in r.cpu_split_ms)
        lines.append(
            f"{r.name:<21}{tag or '-':<13}{r.concurrency:>5}{r.calls:>7}{r.p50_ms:>9.3f}{r.p99_ms:>9.3f}"
            f"{r.rate:>9.0f}{r.cpu_ms_per_call:>13.3f}{split:>23}{ratio:>10.2f}"
        )
    lines.append(
        "route rows: requests carry 4,160 prompt token ids (len-only: the length alone);"
        " pull = check-out txn + prefix check over 256 blocks"
    )
    lines.append(
        "etcd txn: the check-out's transaction alone from a bare client (client/etcd CPU);"
        " a pull's p50 cannot be below recompute's plus this"
    )
    for tag, r in results:
        if r.decisions:
            mix = ", ".join(f"{name} {count}" for name, count in r.decisions)
            lines.append(f"{r.name} ({tag}, conc {r.concurrency}) decisions: {mix}")
    lines.append("targets: Route p50 <= 2.00x echo p50; CPU <= 1.5 ms per Route (client + routing + etcd)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve-echo":
        asyncio.run(_serve_echo(int(argv[1])))
        return 0
    if argv and argv[0] == "serve-routing":
        asyncio.run(_serve_routing(int(argv[1]), argv[2], argv[3], argv[4] == "on"))
        return 0
    parser = argparse.ArgumentParser(prog="route_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls-c1", type=int, default=1000, help="calls per phase at concurrency 1")
    parser.add_argument("--calls-c64", type=int, default=3000, help="calls per phase at concurrency 64")
    parser.add_argument(
        "--tracing",
        choices=("off", "on", "both"),
        default="both",
        help="routing replica rounds: tracing off, on (every span encoded), or both",
    )
    args = parser.parse_args(argv)
    rounds = {"off": (False,), "on": (True,), "both": (False, True)}[args.tracing]
    results = run_until_stopped(run(args.calls_c1, args.calls_c64, rounds))
    if results is None:
        return stopped()
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
