"""How long a request waits on a full decode engine for kvplane to give it memory back.

Starts etcd, `kvplane serve all` (its eviction leader with the `demand` plugin
alone, and policy rounds only every 30 s, so whatever is released is the demand
path's doing) and a prefill and a decode sim-engine (real NIXL over loopback).
The decode engine holds `--blocks` KV blocks; three retained conversations
leave too few free for a 200-token prompt. Each round then sends:

1. the measured request to D: it waits for KV; D's node agent reports the
   demand on its command stream, the leader releases the least valuable
   handle through the fenced etcd transaction, the command comes back on the
   stream, D frees the blocks, and the request runs;
2. the baseline: the same request again, now that memory is free;
3. one more retained turn, which fills D again.

The wait for memory is the first minus the second (demand to free, through the
whole control plane). Everything shares the machine's cores:

    python -m kvplane.bench.demand_bench --rounds 20

`--json PATH` writes the figures (ms) with the command that measured them; the
simulator's demand latency (`kvplane.bench.sim.retention.MEASURED_DEMAND_LATENCY_S`)
is the p50 wait of `bench/results/demand_bench.json`, measured at `--speedup 1`
(the sim-engine at the simulated model's own timing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvplane.connector.simengine.settings import Role, SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_TENANT, fresh_prefill_params
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import (
    ManagedProcess,
    grpc_health_probe,
    http_health_probe,
    run_until_stopped,
    stopped,
    wait_ready,
)
from kvplane.services.devstack.stack import engine_env
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc

TENANT = "bench"
# The stack runs in mesh mode; this process and the engines present the proxy's secret, as a
# mesh proxy would on their behalf.
MESH_SECRET = "demand-bench-secret"
# How long a process of the bench stack may take to come up, s.
READY_TIMEOUT_S = 120.0
SERVICES_ENV = {
    "KVPLANE_AUTH__MODE": "mesh",
    "KVPLANE_AUTH__MESH_EXPERIMENTAL": "true",
    "KVPLANE_AUTH__MESH__SECRETS": json.dumps([MESH_SECRET]),
    # This process routes as a tenant calling Route itself.
    "KVPLANE_AUTH__TENANTS_SEE_ENGINES": "true",
}
TENANT_HEADERS = (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-tenant", TENANT))
MODEL = DEMO_MODEL
PROMPT_TOKENS = 200
RETAINED_OUTPUT = 100


@dataclass(frozen=True)
class Round:
    full_s: float
    free_s: float

    @property
    def wait_s(self) -> float:
        return self.full_s - self.free_s


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 30000) for _ in range(n)]


class Bench:
    def __init__(self, session: aiohttp.ClientSession, p_url: str, d_url: str, target: str) -> None:
        self.session = session
        self.p_url = p_url
        self.d_url = d_url
        self.target = target
        self.rng = random.Random(7)
        self.conversations = 0

    async def post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            out: dict[str, Any] = await r.json()
            return out

    async def retained_turn(self, channel: grpc.aio.Channel) -> None:
        """A routed turn whose KV D retains and publishes; returns once the handle is published."""
        self.conversations += 1
        conversation = f"conv-{self.conversations}"
        prompt = _tokens(self.rng, PROMPT_TOKENS)
        p_out = await self.post(
            self.p_url,
            {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": fresh_prefill_params()},
        )
        d_params = dict(p_out["kv_transfer_params"], **{KEY_TENANT: TENANT, KEY_CONVERSATION: conversation})
        await self.post(
            self.d_url,
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": RETAINED_OUTPUT,
                "ignore_eos": True,
                "kv_transfer_params": d_params,
            },
        )
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        request = metadata_pb2.GetHandleRequest(tenant=TENANT, conversation=conversation)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                await stub.GetHandle(request, metadata=TENANT_HEADERS, timeout=2)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            await asyncio.sleep(0.02)  # polling until the publish lands
        raise RuntimeError(f"{conversation} was never published")

    async def timed_request(self) -> float:
        body = {"model": MODEL, "prompt": _tokens(self.rng, PROMPT_TOKENS), "max_tokens": 1}
        started = time.perf_counter()
        await self.post(self.d_url, body)
        return time.perf_counter() - started

    async def free_blocks(self) -> int:
        async with self.session.get(self.d_url + "/sim/state") as r:
            state: dict[str, Any] = await r.json()
            return int(state["load"]["free_kv_blocks"])


async def run(rounds: int, blocks: int, speedup: float, run_dir: Path) -> list[Round]:
    host = "127.0.0.1"
    grpc_port, p_port, d_port = free_port(), free_port(), free_port()
    target = f"{host}:{grpc_port}"
    config = run_dir / "services.yaml"
    config.write_text(  # JSON is YAML
        json.dumps({"eviction": {"policy": {"policies": [{"name": "demand"}]}, "evaluate_interval_s": 30}})
    )
    kvplane = [sys.executable, "-m", "kvplane.services.cli"]
    processes: list[ManagedProcess] = []
    with LocalEtcd(host) as etcd:
        try:
            services = ManagedProcess(
                "kvplane serve all",
                [
                    *kvplane,
                    "serve",
                    "all",
                    "--listen",
                    target,
                    "--etcd",
                    etcd.endpoint,
                    "--config",
                    str(config),
                ],
                run_dir / "services.log",
                env=SERVICES_ENV,
            )
            processes.append(services)
            services.start()
            await wait_ready(services, grpc_health_probe(target), READY_TIMEOUT_S)
            # D gets `blocks` of KV; P the default.
            roles: tuple[tuple[Role, int, int], ...] = (
                ("prefill", p_port, SimEngineSettings.num_blocks),
                ("decode", d_port, blocks),
            )
            for role, port, num_blocks in roles:
                sim = SimEngineSettings(
                    role=role,
                    node_id=role[0] + "0",
                    http_host=host,
                    http_port=port,
                    side_channel_host=host,
                    side_channel_port=free_port(),
                    control_plane=target,
                    model=MODEL,
                    timing=TimingModel(speedup=speedup),
                    block_size=16,
                    num_blocks=num_blocks,
                    mesh_secret=MESH_SECRET,
                )
                engine = ManagedProcess(
                    f"{role} sim-engine",
                    [*kvplane, "sim-engine", *sim.argv()],
                    run_dir / f"{role}.log",
                    env=engine_env(),
                )
                processes.append(engine)
                engine.start()
            for engine, port in zip(processes[1:], (p_port, d_port), strict=True):
                await wait_ready(engine, http_health_probe(f"http://{host}:{port}/health"), READY_TIMEOUT_S)
            async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(target) as channel:
                bench = Bench(session, f"http://{host}:{p_port}", f"http://{host}:{d_port}", target)
                per_handle = -(-(PROMPT_TOKENS + RETAINED_OUTPUT - 1) // 16)
                while await bench.free_blocks() >= -(-PROMPT_TOKENS // 16) + per_handle:
                    await bench.retained_turn(channel)
                await bench.retained_turn(channel)
                results = []
                for _ in range(rounds):
                    if await bench.free_blocks() >= -(-PROMPT_TOKENS // 16):
                        raise RuntimeError("D has room: the measured request would not wait")
                    full = await bench.timed_request()
                    free = await bench.timed_request()
                    results.append(Round(full, free))
                    await bench.retained_turn(channel)
                return results
        finally:
            for proc in reversed(processes):
                proc.stop()


def _ms(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(results: Sequence[Round], blocks: int, speedup: float, command: str) -> dict[str, Any]:
    """What `--json` writes: p50, p90 and max of each latency, in ms."""

    def stats(values: Sequence[float]) -> dict[str, float]:
        return {
            "p50": round(_ms(values, 0.5), 1),
            "p90": round(_ms(values, 0.9), 1),
            "max": round(1000 * max(values), 1),
        }

    return {
        "command": command,
        "rounds": len(results),
        "decode_blocks": blocks,
        "speedup": speedup,
        "full_ms": stats([r.full_s for r in results]),
        "free_ms": stats([r.free_s for r in results]),
        "wait_ms": stats([r.wait_s for r in results]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=64, help="D's KV blocks (16 tokens each)")
    parser.add_argument("--speedup", type=float, default=50.0, help="sim-engine time divisor")
    parser.add_argument("--json", type=Path, help="write the figures (ms) here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvplane-demand-") as run_dir:
        results = run_until_stopped(run(args.rounds, args.blocks, args.speedup, Path(run_dir)))
    if results is None:
        return stopped()
    full = [r.full_s for r in results]
    free = [r.free_s for r in results]
    wait = [r.wait_s for r in results]
    print(f"release on demand, sim-engine stack: {len(results)} rounds, D with {args.blocks} blocks")
    print(f"{'request on D':<34} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8}")
    for name, values in (
        ("full: waits for a release", full),
        ("baseline: memory free", free),
        ("wait for memory (full - baseline)", wait),
    ):
        print(f"{name:<34} {_ms(values, 0.5):>8.1f} {_ms(values, 0.9):>8.1f} {1000 * max(values):>8.1f}")
    print(f"full / baseline, p50: {statistics.median(full) / statistics.median(free):.2f}x")
    if args.json:
        command = f"python -m kvplane.bench.demand_bench --rounds {args.rounds} --blocks {args.blocks}"
        command += f" --speedup {args.speedup:g}"
        data = figures(results, args.blocks, args.speedup, command)
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
