"""What a gRPC message costs a Python process in CPU: a unary call against a message on an open
client stream, each side measured, in one run.

    python -m kvplane.bench.grpc_cpu_bench [--messages 1000] [--repeats 2]

kvplane's control path is Python gRPC (grpc.aio) between its processes: a turn's Route and its
report are unary calls from the gateway to routing, and each engine's load and prefix-cache
changes reach routing as messages on one long-lived stream. Much of the control path's CPU per
turn, and of its idle cost, is gRPC's own, not kvplane's code; this benchmark isolates it:

- a server process answers a unary call with its request (`Echo`) and counts the messages of a
  client-streaming call (`Count`), both on raw bytes (no protobuf work on either side);
- this process sends `--messages` messages one at a time, `--gap-ms` apart (so that each finds
  both sides' threads as a real control path's messages find them, not in a tight loop): as
  unary calls, or on one open stream;
- each side's CPU (user + system, every thread) is read around each block, in clock ticks (10 ms
  here): blocks of a thousand messages or more read it to about 1%.

Blocks of each mode alternate, `--repeats` times, so a machine's load falls on both alike.
Printed: CPU per message of each side and each mode, and the stream's against the unary call's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

import grpc

from kvplane.bench.route_bench import cpu_seconds
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.processes import run_until_stopped, stopped

_SERVICE = "kvplane.bench.Cpu"
_PAYLOAD = b"x" * 300  # about a Route request's size

UNARY = "unary call"
STREAM = "message on an open stream"
MODES = (UNARY, STREAM)
SERVER, CLIENT = "server", "client"


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def _count(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    n = 0
    async for _ in requests:
        n += 1
    return str(n).encode()


async def serve(port: int) -> None:
    """The server process: `Echo` and `Count` on `port`."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handlers = grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Count": grpc.stream_unary_rpc_method_handler(_count),
        },
    )
    server.add_generic_rpc_handlers((handlers,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _start_server(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "kvplane.bench.grpc_cpu_bench", "--serve", str(port)])


async def _block(channel: grpc.aio.Channel, mode: str, messages: int, gap_s: float) -> None:
    if mode == UNARY:
        echo: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(f"/{_SERVICE}/Echo")
        for _ in range(messages):
            await echo(_PAYLOAD)
            await asyncio.sleep(gap_s)
        return
    count: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(f"/{_SERVICE}/Count")
    call = count()
    for _ in range(messages):
        await call.write(_PAYLOAD)
        await asyncio.sleep(gap_s)
    await call.done_writing()
    if int(await call) != messages:
        raise RuntimeError("the server counted another number of messages")


async def run(messages: int, gap_s: float, repeats: int) -> dict[tuple[str, str], list[float]]:
    """CPU ms per message, by (mode, side), one sample per block."""
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    port = free_port()
    server = _start_server(port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            async with asyncio.timeout(30):
                await channel.channel_ready()
            for mode in MODES:  # warm both paths up, unmeasured
                await _block(channel, mode, 50, gap_s)
            for repeat in range(repeats):
                for mode in MODES[repeat % 2 :] + MODES[: repeat % 2]:
                    before = (cpu_seconds(server.pid), cpu_seconds(os.getpid()))
                    started = time.monotonic()
                    await _block(channel, mode, messages, gap_s)
                    after = (cpu_seconds(server.pid), cpu_seconds(os.getpid()))
                    samples[(mode, SERVER)].append((after[0] - before[0]) * 1e3 / messages)
                    samples[(mode, CLIENT)].append((after[1] - before[1]) * 1e3 / messages)
                    print(
                        f"==> repeat {repeat}: {mode}, {time.monotonic() - started:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        server.terminate()
        server.wait()
    return samples


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def report(samples: dict[tuple[str, str], list[float]], messages: int, gap_s: float, repeats: int) -> str:
    rows = []
    for side in (SERVER, CLIENT):
        unary = _mean(samples[(UNARY, side)])
        stream = _mean(samples[(STREAM, side)])
        spread = ", ".join(f"{v:.3f}" for v in samples[(STREAM, side)])
        rows.append(
            f"| {side} | {unary:.3f} [{', '.join(f'{v:.3f}' for v in samples[(UNARY, side)])}] | "
            f"{stream:.3f} [{spread}] | {f'{stream / unary:.2f}x' if unary > 0 else 'n/a'} |"
        )
    return "\n".join(
        [
            f"{messages} messages of {len(_PAYLOAD)} bytes a block, {gap_s * 1e3:g} ms apart, {repeats} "
            f"repeats, blocks alternating; grpcio {grpc.__version__}, loopback",
            "",
            "| side | unary call, CPU ms [per block] | message on an open stream, CPU ms [per block] "
            "| stream vs unary |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvplane.bench.grpc_cpu_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--messages", type=int, default=1000, help="messages per block (default 1000)")
    parser.add_argument("--gap-ms", type=float, default=5.0, help="pause between messages, ms (default 5)")
    parser.add_argument("--repeats", type=int, default=2, help="blocks of each mode (default 2)")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.messages < 1 or args.repeats < 1 or args.gap_ms < 0:
        parser.error("--messages and --repeats must be at least 1, --gap-ms not negative")
    gap_s = args.gap_ms / 1e3
    samples = run_until_stopped(run(args.messages, gap_s, args.repeats))
    if samples is None:
        return stopped()
    print(report(samples, args.messages, gap_s, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
