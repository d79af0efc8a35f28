"""Publish and check-out cost, beside bare etcd puts and transactions.

Starts a real etcd (tmpfs) and the metadata service, then measures at each
concurrency: bare etcd Put and a bare compare-and-put Txn through the store's
own etcd client, then PublishHandles and CheckOutHandle over gRPC, and the
store's publish and check-out called in process. Prints latency p50/p99,
throughput, and ratios against the bare operations of the same run.

    .venv/bin/python -m kvplane.bench.metadata_bench [--ops 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import grpc
from aetcd import rpc

from kvplane.connector.digests import digest_tokens
from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.processes import run_until_stopped, stopped
from kvplane.services.metadata.app import install
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

# The benchmark's services run in mesh mode; calls carry the proxy's secret, as a mesh proxy would.
MESH_SECRET = uuid.uuid4().hex
NODE_MD = (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-role", "node"), ("x-kvplane-node", "bench-d0"))
TENANT_MD = (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-tenant", "bench"))


@dataclass(frozen=True)
class Result:
    op: str
    concurrency: int
    ops: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float


async def measure(op: str, concurrency: int, count: int, call: Callable[[int], Awaitable[object]]) -> Result:
    latencies: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            start = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - start)

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    latencies.sort()
    return Result(
        op,
        concurrency,
        count,
        statistics.median(latencies) * 1e3,
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3,
        count / elapsed,
    )


def _node() -> Node:
    return Node(
        node_id="bench-d0",
        incarnation=uuid.uuid4().hex,
        role=NodeRole.DECODE,
        engine_id="engine-bench",
        http_url="http://127.0.0.1:8000",
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        fingerprint=Fingerprint("bench"),
        block_size=16,
    )


def _handle(node: Node, conversation: str, tokens: list[int]) -> CacheHandle:
    vllm = VllmHandle.from_kv_transfer_params(
        {
            "remote_engine_id": node.engine_id,
            "remote_request_id": f"req-{conversation}",
            "remote_block_ids": [list(range(len(tokens) // 16))],
            "remote_num_tokens": len(tokens),
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_blocks_expiry_time": 1000.0,
        }
    )
    return CacheHandle(
        "",
        "bench",
        conversation,
        node.node_id,
        node.incarnation,
        vllm,
        int(time.time() * 1000) + 600_000,
        len(tokens) * 4096,
        digest_tokens(tokens, 16),
        model="bench",
    )


async def run(ops: int, concurrencies: list[int]) -> list[Result]:
    results: list[Result] = []
    with LocalEtcd() as etcd:
        settings = KvplaneSettings.model_validate(
            {
                "grpc": {"listen": f"127.0.0.1:{free_port()}"},
                "etcd": {"endpoints": [etcd.endpoint], "prefix": f"/bench/{uuid.uuid4().hex}/"},
                "telemetry": {"metrics_port": 0},
                # The tenant checks handles out itself, as a gateway-less client does.
                "auth": {
                    "mode": "mesh",
                    "mesh_experimental": True,
                    "mesh": {"secrets": [MESH_SECRET]},
                    "tenants_see_engines": True,
                },
            }
        )
        process = ServiceProcess(settings, [install], Telemetry.disabled())
        await process.start()
        store = process.store
        node = _node()
        await store.register_node(node, 600)
        tokens = list(range(8192))  # an 8k-token conversation: ~512 blocks, digests included
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
            stub: metadata_pb2_grpc.MetadataServiceAsyncStub = metadata_pb2_grpc.MetadataServiceStub(channel)
            for c in concurrencies:
                results += await _round(c, ops, process, stub, node, tokens)
        await process.stop()
    return results


async def _round(
    c: int,
    ops: int,
    process: ServiceProcess,
    stub: metadata_pb2_grpc.MetadataServiceAsyncStub,
    node: Node,
    tokens: list[int],
) -> list[Result]:
    store = process.store
    out: list[Result] = []
    run_id = uuid.uuid4().hex[:8]
    value = b"x" * 1024

    async def bare_put(i: int) -> object:
        key = f"/bench-bare/{run_id}/{i}".encode()
        return await store.etcd.kv.Put(rpc.PutRequest(key=key, value=value), timeout=5)

    async def bare_txn(i: int) -> object:
        key = f"/bench-bare/{run_id}/{i}".encode()
        compare = [rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)]
        success = [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))]
        return await store.etcd.kv.Txn(rpc.TxnRequest(compare=compare, success=success), timeout=5)

    async def publish(i: int) -> object:
        handle = convert.handle_to_pb(_handle(node, f"g-{run_id}-{i}", tokens))
        return await stub.PublishHandles(
            metadata_pb2.PublishHandlesRequest(handles=[handle]), metadata=NODE_MD
        )

    async def checkout(i: int) -> object:
        return await stub.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(conversation=f"g-{run_id}-{i}"), metadata=TENANT_MD
        )

    async def store_publish(i: int) -> object:
        return await store.publish_handle(_handle(node, f"s-{run_id}-{i}", tokens))

    async def store_checkout(i: int) -> object:
        return await store.check_out("bench", f"s-{run_id}-{i}")

    out.append(await measure("etcd put (bare)", c, ops, bare_put))
    out.append(await measure("etcd txn (bare)", c, ops, bare_txn))
    out.append(await measure("PublishHandles (gRPC)", c, ops, publish))
    out.append(await measure("CheckOutHandle (gRPC)", c, ops, checkout))
    out.append(await measure("store.publish_handle", c, ops, store_publish))
    out.append(await measure("store.check_out", c, ops, store_checkout))
    return out


def table(results: list[Result]) -> str:
    base: dict[tuple[int, str], Result] = {}
    for r in results:
        if r.op == "etcd put (bare)":
            base[(r.concurrency, "put")] = r
        if r.op == "etcd txn (bare)":
            base[(r.concurrency, "txn")] = r
    lines = [
        "| op | callers | p50 ms | p99 ms | ops/s | p50 vs bare put | p50 vs bare txn | ops/s vs bare txn |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        put, txn = base[(r.concurrency, "put")], base[(r.concurrency, "txn")]
        lines.append(
            f"| {r.op} | {r.concurrency} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.throughput_per_s:.0f} | "
            f"{r.p50_ms / put.p50_ms:.2f}x | {r.p50_ms / txn.p50_ms:.2f}x | "
            f"{r.throughput_per_s / txn.throughput_per_s:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=1000, help="operations per measurement")
    parser.add_argument("--concurrency", default="1,64", help="comma-separated caller counts")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    results = run_until_stopped(run(args.ops, [int(c) for c in args.concurrency.split(",")]))
    if results is None:
        raise SystemExit(stopped())
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
