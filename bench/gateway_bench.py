"""The gateway's own CPU per turn, beside vLLM's example P/D proxy and a bare proxy, in one run.

    python -m kvplane.bench.gateway_bench [--conversations 40] [--turns 2] [--concurrency 4]

Starts the dev stack (etcd, `serve all`, one prefill and one decode sim-engine,
the gateway) and, each in a process of its own, two proxies that do per
request what vLLM's disaggregated example proxy does: the P leg (`max_tokens`
1, `do_remote_decode`), then the D leg with P's `kv_transfer_params`, D's
answer streamed back chunk by chunk; no routing, no state, no checks, no auth.

- The example-proxy stack (`kvplane.bench.example_proxy`) is built as vLLM's
  example is, on what uvicorn finds in a vLLM environment: FastAPI on uvicorn
  (uvloop, httptools), httpx to the engines.
  The gateway's CPU target is stated against it: gateway / example stack
  under 1.
- The bare proxy (here) does the same work on aiohttp, the gateway's own HTTP
  stack, and nothing else: a floor, so gateway / bare proxy is what kvplane's
  own work per turn costs over forwarding, not a difference of HTTP stacks.

The same conversations (token-id prompts, each later turn the previous prompt,
its answer and a new user message) go through each front in alternating
batches, with other token ids, so that no front finds another's blocks in
P's prefix cache. Printed per turn: the CPU of the front process (gateway or
proxy), read from /proc over its own batches, and for kvplane also what the
control plane (`serve all`: Route, ReportTurn, the check-out) and etcd used
meanwhile; the idle CPU of each front (its background work: health probes,
metrics) is shown apart, per second.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvplane.bench.live import token_chat
from kvplane.bench.route_bench import cpu_seconds
from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import run_until_stopped, stopped

MODEL = DEMO_MODEL
# A front's CPU counter has settled once it moves less than this in SETTLE_S (one clock tick is 10 ms).
SETTLE_CPU_S = 0.011
SETTLE_S = 0.3


# -- the bare proxy (its own process) ----------------------------------------------


async def _serve_proxy(port: int, prefill: str, decode: str) -> None:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": fresh_prefill_params()}
        async with session.post(f"{prefill}/v1/completions", json=p_body) as p_resp:
            p_answer = await p_resp.json()
        d_body = {**body, "kv_transfer_params": p_answer.get("kv_transfer_params")}
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        async with session.post(f"{decode}/v1/completions", json=d_body) as d_resp:
            async for chunk in d_resp.content.iter_any():
                await response.write(chunk)
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    try:
        await asyncio.Event().wait()  # until the benchmark terminates the process
    finally:
        await session.close()
        await runner.cleanup()


# -- load -----------------------------------------------------------------------------


@dataclass
class FrontResult:
    name: str
    turns: int = 0
    cpu_s: float = 0.0
    # CPU of the other processes measured with this front (control plane, etcd), by name.
    others_s: dict[str, float] = field(default_factory=dict)
    idle_cpu_per_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    decisions: Counter[str] = field(default_factory=Counter)

    def per_turn_ms(self, seconds: float) -> float:
        return seconds / max(1, self.turns) * 1000


async def _conversation(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    seed: int,
    args: argparse.Namespace,
    result: FrontResult,
) -> None:
    async for decision, ttft, output in token_chat(
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
        if len(output) != args.max_tokens:
            # A stream the client cannot read would make its front look cheap.
            raise RuntimeError(
                f"{url}: {len(output)} output tokens read from the stream, not {args.max_tokens}"
            )
        result.turns += 1
        result.ttft_ms.append(ttft)
        result.decisions[decision or "-"] += 1


async def _settled(pids: Sequence[int]) -> list[float]:
    """CPU of each process once the front has finished its background work (reports)."""
    before = [cpu_seconds(p) for p in pids]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await asyncio.sleep(SETTLE_S)  # one sampling period of the CPU counters
        now = [cpu_seconds(p) for p in pids]
        if now[0] - before[0] < SETTLE_CPU_S:
            return now
        before = now
    return before


async def _batch(
    session: aiohttp.ClientSession,
    url: str,
    headers_for: Any,
    seeds: Sequence[int],
    args: argparse.Namespace,
    result: FrontResult,
    pids: dict[str, int],
) -> None:
    names = list(pids)
    start = await _settled(list(pids.values()))
    queue = iter(seeds)

    async def worker() -> None:
        for seed in queue:
            await _conversation(session, url, headers_for(seed), seed, args, result)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    end = await _settled(list(pids.values()))
    result.cpu_s += end[0] - start[0]
    for name, a, b in zip(names[1:], start[1:], end[1:], strict=True):
        result.others_s[name] = result.others_s.get(name, 0.0) + b - a


async def _idle_rate(pid: int, seconds: float = 2.0) -> float:
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)  # the measurement window
    return (cpu_seconds(pid) - before) / seconds


async def _start_proxy(name: str, *argv: str) -> asyncio.subprocess.Process:
    """A proxy in a process of its own, once it says it listens."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *argv, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = await proc.stdout.readline()
    if line.strip() != b"ready":
        proc.terminate()
        await proc.wait()
        raise RuntimeError(f"the {name} did not start: {line!r}")
    return proc


async def _stop(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        proc.terminate()
        await proc.wait()


@dataclass
class Fronts:
    """The three fronts' results, in the order the report prints them."""

    kvplane: FrontResult
    example: FrontResult
    bare: FrontResult


async def run(args: argparse.Namespace) -> Fronts:
    from kvplane.services.devstack.stack import DEMO_API_KEY, start_stack

    stack = await start_stack(progress=lambda m: print(f"==> {m}", file=sys.stderr, flush=True))
    proxy: asyncio.subprocess.Process | None = None
    example_proxy: asyncio.subprocess.Process | None = None
    proxy_port, example_port = free_port(), free_port()
    try:
        proxy = await _start_proxy(
            "bare proxy",
            "kvplane.bench.gateway_bench",
            "serve-proxy",
            str(proxy_port),
            stack.prefill_url,
            stack.decode_url,
        )
        example_proxy = await _start_proxy(
            "example proxy",
            "kvplane.bench.example_proxy",
            str(example_port),
            "--prefill",
            stack.prefill_url,
            "--decode",
            stack.decode_url,
        )
        by_name = {p.name: p.proc.pid for p in stack.processes if p.proc is not None}
        gateway_pids = {
            "gateway": by_name["gateway"],
            "serve all": by_name["kvplane serve all"],
        }
        if stack.etcd.proc is not None:
            gateway_pids["etcd"] = stack.etcd.proc.pid
        kvplane = FrontResult("kvplane gateway", idle_cpu_per_s=await _idle_rate(by_name["gateway"]))
        example = FrontResult("example-proxy stack", idle_cpu_per_s=await _idle_rate(example_proxy.pid))
        bare = FrontResult("bare proxy", idle_cpu_per_s=await _idle_rate(proxy.pid))
        gateway_url = f"{stack.gateway_url}/v1/completions"
        example_url = f"http://127.0.0.1:{example_port}/v1/completions"
        proxy_url = f"http://127.0.0.1:{proxy_port}/v1/completions"

        def gateway_headers(seed: int) -> dict[str, str]:
            return {"authorization": f"Bearer {DEMO_API_KEY}", "x-conversation-id": f"bench-{seed}"}

        def no_headers(seed: int) -> dict[str, str]:
            return {}

        rounds = max(1, args.rounds)
        per_round = max(1, args.conversations // rounds)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            fronts = (
                (gateway_url, gateway_headers, kvplane, gateway_pids),
                (example_url, no_headers, example, {"example proxy": example_proxy.pid}),
                (proxy_url, no_headers, bare, {"proxy": proxy.pid}),
            )
            # One conversation each, unmeasured: connections, caches and code paths warmed up.
            for k, (url, headers, _, _) in enumerate(fronts):
                await _conversation(session, url, headers(10**6 + k), 10**6 + k, args, FrontResult("warm"))
            for r in range(rounds):
                # Seeds 3s, 3s+1, 3s+2: the same shapes, other token ids for each front.
                seeds = range(r * per_round, (r + 1) * per_round)
                for k, (url, headers, result, pids) in enumerate(fronts):
                    await _batch(session, url, headers, [3 * s + k for s in seeds], args, result, pids)
        return Fronts(kvplane, example, bare)
    finally:
        await _stop(example_proxy)
        await _stop(proxy)
        stack.stop()


def cpu_ratio(front: FrontResult, baseline: FrontResult) -> float:
    """Front's CPU per turn over the baseline's (inf when the baseline used none)."""
    if baseline.cpu_s <= 0 or front.turns == 0 or baseline.turns == 0:
        return float("inf")
    return (front.cpu_s / front.turns) / (baseline.cpu_s / baseline.turns)


def report(fronts: Fronts, args: argparse.Namespace) -> str:
    kvplane = fronts.kvplane
    lines = [
        f"{args.conversations} conversations x {args.turns} turns, {args.prompt_tokens}-token first"
        f" prompts, {args.user_tokens} new tokens a turn, {args.max_tokens} output tokens,"
        f" concurrency {args.concurrency}",
        f"{'front':<21}{'turns':>7}{'CPU ms/turn':>13}{'idle CPU ms/s':>15}{'TTFT p50 ms':>13}"
        "  with it, ms/turn",
    ]
    for r in (kvplane, fronts.example, fronts.bare):
        others = ", ".join(f"{name} {r.per_turn_ms(s):.2f}" for name, s in r.others_s.items())
        lines.append(
            f"{r.name:<21}{r.turns:>7}{r.per_turn_ms(r.cpu_s):>13.2f}{r.idle_cpu_per_s * 1000:>15.1f}"
            f"{statistics.median(r.ttft_ms):>13.1f}  {others}"
        )
    lines.append(
        f"gateway CPU per turn / example-proxy stack's: {cpu_ratio(kvplane, fronts.example):.2f}x"
        " (the target: under 1.0)"
    )
    lines.append(
        f"gateway CPU per turn / bare proxy's: {cpu_ratio(kvplane, fronts.bare):.2f}x"
        " (the floor: forwarding alone, on aiohttp)"
    )
    lines.append("gateway decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(kvplane.decisions.items())))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve-proxy":
        asyncio.run(_serve_proxy(int(argv[1]), argv[2], argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="gateway_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=40, help="conversations per front")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="first prompt, tokens")
    parser.add_argument("--user-tokens", type=int, default=64, help="new user tokens in each later turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per turn")
    parser.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    parser.add_argument("--rounds", type=int, default=4, help="alternating batches per front")
    args = parser.parse_args(argv)
    results = run_until_stopped(run(args))
    if results is None:
        return stopped()
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
