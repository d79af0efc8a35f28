"""What a gRPC call costs when the event loop on either side is busy, against the same call between
idle loops, in one run.

    python -m kvplane.bench.grpc_hop_bench [--calls 300] [--busy-ms 2] [--repeats 2]

The gateway asks routing for every turn's Route over gRPC (grpc.aio). Under load the gateway's event
loop is busy relaying the engines' streams, and the call's answer reaches the awaiting coroutine
only after several passes of that loop: grpc.aio completes a call in steps (its completion queue's
poller thread hands each event to the loop), and each step waits for the loop's other ready work.
This benchmark isolates that cost from everything else a turn does:

- a server process answers a unary call (gRPC's health Check: the smallest call there is), its
  loop idle, or busy with a task that holds it for `--busy-ms` of CPU between yields;
- this process calls it, one call at a time, its own loop idle or busy the same way;
- beside them, the same busy loop awaiting a coroutine that answers at once (what routing in the
  gateway's own process costs the turn: `kvplane gateway --grpc-listen`, the comparison's
  `kvplane-colocated`).

Blocks of each condition alternate, `--repeats` times, so a machine's load falls on all alike.
Printed: each condition's call latency p50 and p99, and its p50 against idle loops'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvplane.bench.compare_report import percentile
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.processes import run_until_stopped, stopped

# A pause between calls, so that each call starts on a loop in its steady state.
_GAP_S = 0.005


async def _hold_loop(busy_s: float) -> None:
    """Keeps the running loop busy: `busy_s` of CPU, then a yield to its other ready work."""
    while True:
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def _busy(busy_s: float, on: bool) -> AsyncIterator[None]:
    task = asyncio.create_task(_hold_loop(busy_s)) if on else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def serve(port: int, busy_s: float) -> None:
    """The server process: health Check on `port`, its loop busy when `busy_s` > 0."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    async with _busy(busy_s, busy_s > 0):
        await server.wait_for_termination()


def _start_server(busy_s: float) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    args = [sys.executable, "-m", "kvplane.bench.grpc_hop_bench", "--serve", str(port), "--busy-ms"]
    proc = subprocess.Popen([*args, str(busy_s * 1e3)])
    return proc, port


async def _timed(call: Callable[[], Awaitable[object]], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        await call()
        out.append((time.perf_counter() - start) * 1e3)
        await asyncio.sleep(_GAP_S)
    return out


async def _grpc_block(port: int, caller_busy: bool, busy_s: float, calls: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        await channel.channel_ready()
        await stub.Check(request, wait_for_ready=True)

        async def call() -> object:
            return await stub.Check(request)

        async with _busy(busy_s, caller_busy):
            return await _timed(call, calls)


async def _in_process_block(busy_s: float, calls: int) -> list[float]:
    async def call() -> object:
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async with _busy(busy_s, True):
        return await _timed(call, calls)


IDLE = "gRPC, both loops idle"
CALLER_BUSY = "gRPC, the caller's loop busy"
SERVER_BUSY = "gRPC, the server's loop busy"
BOTH_BUSY = "gRPC, both loops busy"
IN_PROCESS = "no hop: a coroutine of the caller's process, its loop busy"
CONDITIONS = (IDLE, CALLER_BUSY, SERVER_BUSY, BOTH_BUSY, IN_PROCESS)


async def run(calls: int, busy_s: float, repeats: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = defaultdict(list)
    servers = {busy: _start_server(busy_s if busy else 0.0) for busy in (False, True)}
    try:
        for repeat in range(repeats):
            order = CONDITIONS[repeat % len(CONDITIONS) :] + CONDITIONS[: repeat % len(CONDITIONS)]
            for condition in order:
                if condition == IN_PROCESS:
                    samples[condition] += await _in_process_block(busy_s, calls)
                else:
                    server_busy = condition in (SERVER_BUSY, BOTH_BUSY)
                    caller_busy = condition in (CALLER_BUSY, BOTH_BUSY)
                    port = servers[server_busy][1]
                    samples[condition] += await _grpc_block(port, caller_busy, busy_s, calls)
                print(f"==> repeat {repeat}: {condition}", file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    return samples


def report(samples: dict[str, list[float]], calls: int, busy_s: float, repeats: int) -> str:
    idle = percentile(samples[IDLE], 0.5)
    rows = [
        f"| {name} | {len(samples[name])} | {percentile(samples[name], 0.5):.2f} | "
        f"{percentile(samples[name], 0.99):.2f} | {percentile(samples[name], 0.5) / idle:.2f}x |"
        for name in CONDITIONS
    ]
    return "\n".join(
        [
            f"one unary call at a time ({calls} a block, {repeats} repeats, blocks alternating); a busy "
            f"loop runs {busy_s * 1e3:g} ms of CPU between yields",
            "",
            "| condition | calls | p50 ms | p99 ms | p50 vs idle loops |",
            "|---|---:|---:|---:|---:|",
            *rows,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvplane.bench.grpc_hop_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--calls", type=int, default=300, help="calls per block (default 300)")
    parser.add_argument(
        "--busy-ms", type=float, default=2.0, help="CPU a busy loop runs between yields, ms (default 2)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="blocks of each condition (default 2)")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    busy_s = args.busy_ms / 1e3
    if args.serve:
        asyncio.run(serve(args.serve, busy_s))
        return 0
    if args.calls < 1 or args.repeats < 1 or args.busy_ms <= 0:
        parser.error("--calls and --repeats must be at least 1, --busy-ms above 0")
    samples = run_until_stopped(run(args.calls, busy_s, args.repeats))
    if samples is None:
        return stopped()
    print(report(samples, args.calls, busy_s, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
