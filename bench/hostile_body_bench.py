"""A legitimate turn's TTFT while another tenant sends the costliest bodies, against the same turn
alone, in one run.

    python -m kvplane.bench.hostile_body_bench [--repeats 3] [--turns 8] [--attackers 8]

Starts the dev stack (etcd, `serve all`, one prefill and one decode sim-engine, the gateway,
which knows the engines' context length) and runs blocks of one tenant's single-turn requests of about 2,000
token ids, one at a time, streamed, timing the first token. Blocks alternate between "alone"
and "under attack": while an attack block runs, `--attackers` clients of another tenant send,
back to back, the bodies that cost the gateway most to parse:

- `ids-16MiB`: 16 MiB of `{"prompt": [0, 0, ...]}`, about 8.4 million token ids;
- `ids-at-cap`: as many token ids as the gateway's value cap lets through to the parser;
- `nested-at-cap`: an unknown field of empty arrays, as many as the cap lets through.

Each is refused (413 by its count, or 400 once parsed: too long, or an empty prompt), so that
what the legitimate turns feel is the gateway's work on the bodies, not the engines'.

Printed: TTFT p50 and p99 of each kind of block, their ratio, and what the attackers were
answered (by status). The gateway's defences are admission.py's value cap (a body's values are
counted, in C, before it is parsed, against twice the context length plus 65,536) and each
tenant's bound on the bytes of its bodies being read at once (429 past it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kvplane.bench.compare_report import percentile
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import run_until_stopped, stopped
from kvplane.services.gateway.admission import json_values_for_context

PROMPT_TOKENS = 2_000
# Token ids clear of the sim-engine's byte tokens.
FIRST_ID = 1_000


@dataclass
class Blocks:
    alone_ms: list[float] = field(default_factory=list)
    attacked_ms: list[float] = field(default_factory=list)
    attacker_answers: Counter[str] = field(default_factory=Counter)
    failed: int = 0


def hostile_bodies(context: int) -> dict[str, bytes]:
    """The bodies the attackers send, by name (see the module's docstring)."""
    cap = json_values_for_context(context)
    # {"prompt": [ids]} holds ids + 2 values by the gateway's count: one under the cap is parsed.
    at_cap = cap - 3
    return {
        "ids-16MiB": b'{"prompt": [' + b"0," * ((16 << 20) // 2 - 16) + b'0], "max_tokens": 1}',
        "ids-at-cap": b'{"prompt": [' + b"0," * (at_cap - 1) + b'0], "max_tokens": 1}',
        "nested-at-cap": b'{"prompt": [], "x": [' + b"[]," * (at_cap // 2 - 8) + b"[]]}",
    }


async def _turn(session: aiohttp.ClientSession, url: str, headers: dict[str, str], seed: int) -> float:
    ids = [FIRST_ID + (seed * 7919 + i) % 20_000 for i in range(PROMPT_TOKENS)]
    body = {"model": DEMO_MODEL, "prompt": ids, "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for _chunk in resp.content.iter_any():
            return (time.perf_counter() - start) * 1e3
    raise RuntimeError("the stream ended before its first token")


async def _attacker(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    bodies: Sequence[bytes],
    answers: Counter[str],
) -> None:
    for n in itertools.count():
        try:
            async with session.post(url, data=bodies[n % len(bodies)], headers=headers) as resp:
                await resp.read()
                answers[str(resp.status)] += 1
        except aiohttp.ClientError as exc:
            answers[type(exc).__name__] += 1


async def attack(url: str, api_key: str, attackers: int) -> Counter[str]:
    """The attackers' process: sends the hostile bodies until SIGTERM; returns the answers by status."""
    answers: Counter[str] = Counter()
    bodies = list(hostile_bodies(SimEngineSettings.max_model_len).values())
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [
            asyncio.create_task(_attacker(session, url, headers, bodies, answers)) for _ in range(attackers)
        ]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return answers


async def _start_attackers(url: str, api_key: str, attackers: int) -> asyncio.subprocess.Process:
    """The attackers in a process of their own, so that their client work is not the legitimate
    client's event loop's."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvplane.bench.hostile_body_bench",
        "--attack",
        url,
        "--api-key",
        api_key,
        "--attackers",
        str(attackers),
        stdout=asyncio.subprocess.PIPE,
    )


async def _stop_attackers(proc: asyncio.subprocess.Process, answers: Counter[str]) -> None:
    proc.terminate()
    out, _ = await proc.communicate()
    for line in out.decode().splitlines():
        status, _, count = line.partition(" ")
        if count.isdigit():
            answers[status] += int(count)


async def run(args: argparse.Namespace) -> Blocks:
    from kvplane.services.devstack.stack import DEMO_API_KEY, OTHER_API_KEY, start_stack

    stack = await start_stack(progress=lambda m: print(f"==> {m}", file=sys.stderr, flush=True))
    blocks = Blocks()
    url = f"{stack.gateway_url}/v1/completions"
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as legit:
            seeds = itertools.count()

            def headers(who: str) -> dict[str, str]:
                key = f"Bearer {DEMO_API_KEY}"
                return {"authorization": key, "x-conversation-id": f"{who}-{next(seeds)}"}

            await _turn(legit, url, headers("warm"), next(seeds))  # connections and code paths warmed up
            for repeat in range(args.repeats):
                # Alternate which kind of block comes first in each repeat.
                for attacked in (repeat % 2 == 1, repeat % 2 == 0):
                    attackers = (
                        await _start_attackers(url, OTHER_API_KEY, args.attackers) if attacked else None
                    )
                    try:
                        for _ in range(args.turns):
                            try:
                                ms = await _turn(legit, url, headers("legit"), next(seeds))
                            except (RuntimeError, aiohttp.ClientError) as exc:
                                blocks.failed += 1
                                print(f"legitimate turn failed: {exc}", file=sys.stderr)
                                continue
                            (blocks.attacked_ms if attacked else blocks.alone_ms).append(ms)
                    finally:
                        if attackers is not None:
                            await _stop_attackers(attackers, blocks.attacker_answers)
                    kind = "under attack" if attacked else "alone"
                    print(f"==> repeat {repeat} {kind}: {args.turns} turns", file=sys.stderr, flush=True)
    finally:
        stack.stop()
    return blocks


def report(blocks: Blocks, args: argparse.Namespace) -> str:
    def row(name: str, ms: Sequence[float]) -> str:
        return f"| {name} | {len(ms)} | {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} |"

    alone, attacked = blocks.alone_ms, blocks.attacked_ms
    p50 = percentile(attacked, 0.5) / percentile(alone, 0.5)
    p99 = percentile(attacked, 0.99) / percentile(alone, 0.99)
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(blocks.attacker_answers.items()))
    return "\n".join(
        [
            f"legitimate turns of {PROMPT_TOKENS} token ids, one at a time; {args.attackers} attackers "
            f"sending the costliest bodies; {args.repeats} repeats of alternating blocks",
            "",
            "| blocks | turns | TTFT p50 ms | TTFT p99 ms |",
            "|---|---:|---:|---:|",
            row("alone", alone),
            row("under attack", attacked),
            "",
            f"under attack / alone: p50 {p50:.2f}x, p99 {p99:.2f}x; legitimate turns failed: {blocks.failed}",
            f"attackers were answered: {answers or 'nothing'}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvplane.bench.hostile_body_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8, help="legitimate turns per block")
    parser.add_argument("--attackers", type=int, default=8, help="clients sending hostile bodies at once")
    # The attackers' own process (started by the benchmark): sends to this URL until SIGTERM.
    parser.add_argument("--attack", default="", help=argparse.SUPPRESS)
    parser.add_argument("--api-key", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.attack:
        for status, count in sorted(asyncio.run(attack(args.attack, args.api_key, args.attackers)).items()):
            print(status, count)
        return 0
    blocks = run_until_stopped(run(args))
    if blocks is None:
        return stopped()
    print(report(blocks, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
