"""How many releases per second the eviction leader sustains against real etcd.

Starts a local etcd, registers `--nodes` decode nodes, publishes `--handles`
handles of 1 MB spread over them, then starts one coordinator whose node
budget allows `--keep-mb` MB per node, with every node connected on the
command stream and acknowledging. Timed from the moment the replica leads
until every over-budget handle has been released (one fenced etcd
transaction each), acknowledged by its node, and deleted from the outbox
(one etcd delete each). Everything shares one Python process and the box's
cores with etcd, so the figures are a floor:

    python -m kvplane.bench.eviction_bench --handles 4000 --nodes 4 --concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.processes import run_until_stopped, stopped
from kvplane.services.eviction.app import install
from kvplane.services.eviction.coordinator import EvictionCoordinator
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc

MB = 1 << 20
# The benchmark's services run in mesh mode; the nodes' calls carry the proxy's secret.
MESH_SECRET = uuid.uuid4().hex


@dataclass(frozen=True)
class Result:
    concurrency: int
    released: int
    decide_s: float
    deliver_s: float
    # Until every acknowledged entry was deleted from the outbox.
    clear_s: float
    # Decision to acknowledgement, upper bucket bounds, seconds.
    delivery_p50_s: float
    delivery_p99_s: float

    @property
    def decided_per_s(self) -> float:
        return self.released / self.decide_s

    @property
    def delivered_per_s(self) -> float:
        return self.released / self.deliver_s


def _node(i: int) -> Node:
    return Node(
        node_id=f"d{i}",
        incarnation=uuid.uuid4().hex,
        role=NodeRole.DECODE,
        engine_id=f"engine-d{i}",
        http_url=f"http://127.0.0.1:{8000 + i}",
        side_channel_host="127.0.0.1",
        side_channel_port=5600 + i,
        fingerprint=Fingerprint("bench"),
        block_size=16,
        kv_capacity_bytes=64 << 30,
    )


def _handle(node: Node, n: int, now_ms: int) -> CacheHandle:
    vllm = VllmHandle(
        node.engine_id, f"req-{n}", ((1, 2, 3),), 8000, node.side_channel_host, node.side_channel_port
    )
    return CacheHandle(
        "",
        "bench",
        f"c{n}",
        node.node_id,
        node.incarnation,
        vllm,
        now_ms + 600_000,
        MB,
        published_unix_ms=now_ms - 1000 * (n % 900),
    )


class AckingNode:
    """A node on the command stream that acknowledges every command at once."""

    def __init__(self, node: Node, target: str) -> None:
        self.node = node
        self.target = target
        self.acked = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._stream()
            await asyncio.sleep(0.05)  # reconnect backoff

    async def _stream(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            out: asyncio.Queue[eviction_pb2.CommandsRequest] = asyncio.Queue()
            out.put_nowait(
                eviction_pb2.CommandsRequest(
                    hello=eviction_pb2.NodeHello(node_id=self.node.node_id, incarnation=self.node.incarnation)
                )
            )

            async def requests() -> AsyncIterator[eviction_pb2.CommandsRequest]:
                while True:
                    yield await out.get()

            call = eviction_pb2_grpc.EvictionServiceStub(channel).Commands(
                requests(),
                metadata=(
                    ("x-kvplane-mesh-secret", MESH_SECRET),
                    ("x-kvplane-role", "node"),
                    ("x-kvplane-node", self.node.node_id),
                ),
            )
            async for command in call:
                out.put_nowait(
                    eviction_pb2.CommandsRequest(
                        ack=eviction_pb2.CommandAck(command_id=command.command_id, ok=True)
                    )
                )
                self.acked += 1


async def _publish(store: Store, nodes: Sequence[Node], count: int) -> None:
    now = int(time.time() * 1000)
    sem = asyncio.Semaphore(64)

    async def one(n: int) -> None:
        async with sem:
            await store.publish_handle(_handle(nodes[n % len(nodes)], n, now))

    await asyncio.gather(*(one(n) for n in range(count)))


async def run_once(etcd: LocalEtcd, handles: int, node_count: int, keep_mb: int, concurrency: int) -> Result:
    prefix = f"/kvplane-bench/{uuid.uuid4().hex}/"
    nodes = [_node(i) for i in range(node_count)]
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    for node in nodes:
        await store.register_node(node, 120)
    await _publish(store, nodes, handles)
    expected = handles - keep_mb * node_count
    settings = KvplaneSettings.model_validate(
        {
            "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 0.2},
            "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix},
            "telemetry": {"metrics_port": 0},
            "auth": {"mode": "mesh", "mesh_experimental": True, "mesh": {"secrets": [MESH_SECRET]}},
            "eviction": {
                "lease_ttl_s": 10,
                "evaluate_interval_s": 0.5,
                "release_concurrency": concurrency,
                "policy": {
                    "policies": [
                        {"name": "node_budget", "high_bytes": keep_mb * MB, "low_bytes": keep_mb * MB}
                    ]
                },
            },
        }
    )
    process = ServiceProcess(settings, [install], Telemetry.disabled())
    coordinator = next(c for c in process.components if isinstance(c, EvictionCoordinator))
    agents = [AckingNode(n, f"127.0.0.1:{settings.grpc.listen.rsplit(':', 1)[1]}") for n in nodes]
    try:
        await process.start()
        await _until(lambda: coordinator.is_leader)
        started = time.monotonic()
        for agent in agents:
            agent.start()
        decided_at = 0.0

        def done() -> bool:
            nonlocal decided_at
            if not decided_at and _released(coordinator) >= expected:
                decided_at = time.monotonic()
            return sum(a.acked for a in agents) >= expected

        await _until(done)
        delivered_at = time.monotonic()
        for node in nodes:
            while True:
                if not await store.pending_releases(node.node_id):
                    break
                await asyncio.sleep(0.01)  # the last acks' deletes
        cleared_at = time.monotonic()
        p50, p99 = _quantiles(coordinator, (0.5, 0.99))
        return Result(
            concurrency,
            expected,
            (decided_at or delivered_at) - started,
            delivered_at - started,
            cleared_at - started,
            p50,
            p99,
        )
    finally:
        for agent in agents:
            await agent.stop()
        await process.stop()
        await store.close()


async def _until(predicate: Callable[[], bool]) -> None:
    while True:
        if predicate():
            return
        await asyncio.sleep(0.005)  # polling: the bench measures, it does not wait on events


def _quantiles(coordinator: EvictionCoordinator, qs: Sequence[float]) -> tuple[float, ...]:
    """Quantiles of the delivery histogram, as the upper bound of the bucket that holds each."""
    buckets: list[tuple[float, float]] = []
    for metric in coordinator.metrics.delivery_seconds.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    return tuple(next((le for le, count in buckets if count >= q * total), float("inf")) for q in qs)


def _released(coordinator: EvictionCoordinator) -> float:
    total = 0.0
    for metric in coordinator.metrics.releases.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--handles", type=int, default=4000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--keep-mb", type=int, default=50, help="node budget (1 MB handles)")
    parser.add_argument(
        "--concurrency", default="1,16,64", help="release transactions in flight, comma-separated"
    )
    args = parser.parse_args(argv)

    async def run() -> list[Result]:
        results = []
        with LocalEtcd() as etcd:
            for c in (int(x) for x in args.concurrency.split(",")):
                results.append(await run_once(etcd, args.handles, args.nodes, args.keep_mb, c))
        return results

    results = run_until_stopped(run())
    if results is None:
        return stopped()
    print(
        f"eviction leader vs real etcd: {args.handles} handles on {args.nodes} nodes, "
        f"{args.keep_mb} MB budget each"
    )
    print(
        f"{'concurrency':>11} {'released':>9} {'decided/s':>10} {'acked at node/s':>16}"
        f" {'outbox clear/s':>15} {'clear s':>8} {'ack p50':>8} {'ack p99':>8}"
    )
    for r in results:
        print(
            f"{r.concurrency:>11} {r.released:>9} {r.decided_per_s:>10.0f} {r.delivered_per_s:>16.0f}"
            f" {r.released / r.clear_s:>15.0f} {r.clear_s:>8.2f}"
            f" {r.delivery_p50_s:>7}s {r.delivery_p99_s:>7}s"
        )
    print("decided: fenced release txns; acked at node: commands acknowledged by the nodes;")
    print("outbox clear: every acknowledged command deleted from etcd; ack p50/p99: decision to deletion,")
    print("as the upper bound of the histogram bucket")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
