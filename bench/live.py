"""`kvplane bench`: a live benchmark against a running gateway (sim-engines or real vLLM).

It drives token-id conversations through the gateway's OpenAI API at a target
rate of new conversations, with a progress line, and reports:

- TTFT by decision (turns that pulled retained KV against turns that recomputed);
- the decision mix, and the share of prompt tokens the prefill engine pulled
  (from its `vllm:prompt_tokens_by_source` metric, when `--prefill` is given);
- the control plane's own cost per turn: the same first-turn request sent to
  the engines directly (P leg then D leg, no kvplane), interleaved with the
  gateway's first turns in the same run, compared by median TTFT.

    kvplane bench --gateway http://127.0.0.1:8080 --api-key KEY \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    kvplane bench --start-stack          # starts `kvplane dev-stack`'s processes itself
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvplane.services.common.handles import fresh_prefill_params


@dataclass(frozen=True)
class TurnResult:
    conversation: str
    turn_index: int
    prompt_tokens: int
    output_tokens: int
    decision: str
    ttft_ms: float
    via: str  # "gateway" or "direct"
    # When the turn was sent, in seconds from the run's start (to replay the same arrivals elsewhere).
    sent_s: float = 0.0


@dataclass
class LiveResult:
    turns: list[TurnResult] = field(default_factory=list)
    pulled_tokens: float = 0.0
    prompt_tokens_on_prefill: float = 0.0
    wall_s: float = 0.0

    def gateway_turns(self) -> list[TurnResult]:
        return [t for t in self.turns if t.via == "gateway"]

    def decision_shares(self) -> dict[str, float]:
        turns = self.gateway_turns()
        counts = Counter(t.decision for t in turns)
        return {k: v / max(1, len(turns)) for k, v in counts.items()}

    def reused_fraction(self) -> float:
        """Prompt tokens P pulled over all prompt tokens P saw (both from P's metrics)."""
        return self.pulled_tokens / self.prompt_tokens_on_prefill if self.prompt_tokens_on_prefill else 0.0


@dataclass(frozen=True)
class Workload:
    conversations: int = 8
    turns: int = 4
    first_tokens: int = 4000
    user_tokens: int = 200
    max_tokens: int = 100
    # New conversations per second (Poisson arrivals); turns of one conversation follow each other.
    rate: float = 2.0
    seed: int = 0


async def _stream_turn(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[str, float, list[int]]:
    """POSTs a streaming completion; returns the decision header, TTFT (ms) and output ids."""
    started = time.perf_counter()
    ttft = 0.0
    output: list[int] = []
    async with session.post(url, json={**body, "stream": True}, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        decision = resp.headers.get("x-kvplane-decision", "")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if (ids or choice.get("text")) and not ttft:
                    ttft = (time.perf_counter() - started) * 1e3
                output += ids
    return decision, ttft, output


async def _direct_turn(
    session: aiohttp.ClientSession, prefill: str, decode: str, body: dict[str, Any]
) -> tuple[float, list[int]]:
    """The same request with no control plane: P leg, then D leg with P's params."""
    started = time.perf_counter()
    p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": fresh_prefill_params()}
    async with session.post(f"{prefill}/v1/completions", json=p_body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"prefill: HTTP {resp.status}: {(await resp.text())[:500]}")
        params = (await resp.json()).get("kv_transfer_params")
    d_started = time.perf_counter()
    _, ttft_d, output = await _stream_turn(
        session, f"{decode}/v1/completions", {**body, "kv_transfer_params": params}, {}
    )
    return (d_started - started) * 1e3 + ttft_d, output


async def _prefill_sources(session: aiohttp.ClientSession, prefill: str) -> tuple[float, float]:
    """(pulled, all) prompt tokens on the prefill engine so far."""
    async with session.get(f"{prefill}/metrics") as resp:
        text = await resp.text()
    pulled = total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, _, value = line.rpartition(" ")
            total += float(value)
            if 'source="external_kv_transfer"' in labels:
                pulled += float(value)
    return pulled, total


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def tick(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            print(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} turns",
                end="",
                file=sys.stderr,
            )
            if self.done == self.total:
                print(file=sys.stderr)


async def drive(
    gateway: str,
    api_key: str,
    workload: Workload,
    *,
    prefill: str = "",
    decode: str = "",
    model: str = "sim-model",
    progress: bool = False,
) -> LiveResult:
    """Runs the workload; with `prefill` and `decode`, also the direct baseline."""
    rng = random.Random(workload.seed)
    result = LiveResult()
    direct = bool(prefill and decode)
    bar = _Progress(workload.conversations * (workload.turns + (1 if direct else 0)), progress)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await _prefill_sources(session, prefill) if prefill else (0.0, 0.0)
        started = time.perf_counter()

        async def conversation(index: int) -> None:
            crng = random.Random(rng.random())
            name = f"bench-{workload.seed}-{index}"
            prompt = [crng.randrange(1000, 30000) for _ in range(workload.first_tokens)]
            for turn in range(workload.turns):
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": workload.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                if direct and turn == 0:
                    # The no-kvplane baseline of a first turn, on the same engines: a prompt of
                    # the same length but other tokens, so neither run warms the other's cache.
                    other = [crng.randrange(1000, 30000) for _ in range(len(prompt))]
                    ttft, out = await _direct_turn(session, prefill, decode, {**body, "prompt": other})
                    result.turns.append(TurnResult(name, 0, len(other), len(out), "direct", ttft, "direct"))
                    bar.tick()
                headers = {"Authorization": f"Bearer {api_key}", "X-Conversation-Id": name}
                sent = time.perf_counter() - started
                decision, ttft, out = await _stream_turn(session, f"{gateway}/v1/completions", body, headers)
                result.turns.append(
                    TurnResult(name, turn, len(prompt), len(out), decision, ttft, "gateway", sent)
                )
                bar.tick()
                prompt = prompt + out + [crng.randrange(1000, 30000) for _ in range(workload.user_tokens)]

        tasks = []
        for i in range(workload.conversations):
            tasks.append(asyncio.create_task(conversation(i)))
            await asyncio.sleep(rng.expovariate(workload.rate))  # Poisson arrivals of conversations
        await asyncio.gather(*tasks)
        result.wall_s = time.perf_counter() - started
        if prefill:
            after = await _prefill_sources(session, prefill)
            result.pulled_tokens = after[0] - before[0]
            result.prompt_tokens_on_prefill = after[1] - before[1]
    return result


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def report(result: LiveResult) -> str:
    lines = ["| turns | n | TTFT p50 ms | p90 ms | p99 ms |", "|---|---:|---:|---:|---:|"]
    groups: dict[str, list[float]] = {}
    for t in result.turns:
        key = (
            "direct to engines (turn 1)"
            if t.via == "direct"
            else ("gateway, turn 1" if t.turn_index == 0 else f"gateway, later turns: {t.decision}")
        )
        groups.setdefault(key, []).append(t.ttft_ms)
    for key in sorted(groups):
        v = groups[key]
        lines.append(f"| {key} | {len(v)} | {_pct(v, 0.5):.1f} | {_pct(v, 0.9):.1f} | {_pct(v, 0.99):.1f} |")
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(result.decision_shares().items()))
    lines += ["", f"decisions: {shares}", f"prompt tokens pulled by P: {result.reused_fraction():.1%}"]
    first_gw = [t.ttft_ms for t in result.turns if t.via == "gateway" and t.turn_index == 0]
    first_direct = [t.ttft_ms for t in result.turns if t.via == "direct"]
    if first_gw and first_direct:
        overhead = statistics.median(first_gw) - statistics.median(first_direct)
        lines.append(
            f"control plane's cost per turn (gateway + route + report), median first-turn TTFT through the "
            f"gateway minus direct: {overhead:+.1f} ms ({statistics.median(first_gw):.1f} vs "
            f"{statistics.median(first_direct):.1f} ms)"
        )
    lines.append(f"wall time: {result.wall_s:.1f} s")
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> LiveResult:
    workload = Workload(
        conversations=args.conversations,
        turns=args.turns,
        first_tokens=args.first_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        rate=args.rate,
        seed=args.seed,
    )
    if not args.start_stack:
        return await drive(
            args.gateway,
            args.api_key,
            workload,
            prefill=args.prefill,
            decode=args.decode,
            model=args.model,
            progress=not args.quiet,
        )
    from kvplane.services.devstack import DEMO_API_KEY, start_stack

    stack = await start_stack(
        progress=lambda m: print(f"==> {m}", file=sys.stderr),
        prefill_args=() if args.prefix_cache else ("--no-enable-prefix-caching",),
    )
    try:
        return await drive(
            stack.gateway_url,
            DEMO_API_KEY,
            workload,
            prefill=stack.prefill_url,
            decode=stack.decode_url,
            model="sim-model",
            progress=not args.quiet,
        )
    finally:
        stack.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvplane bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key", default="dev-key")
    parser.add_argument(
        "--prefill", default="", help="prefill engine URL: pulled-token share and direct baseline"
    )
    parser.add_argument("--decode", default="", help="decode engine URL, for the direct baseline")
    parser.add_argument("--model", default="sim-model")
    parser.add_argument("--start-stack", action="store_true", help="start a dev stack and benchmark it")
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --start-stack: P keeps its prefix cache (then it pulls only D's answer each turn)",
    )
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-tokens", type=int, default=4000)
    parser.add_argument("--user-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--rate", type=float, default=2.0, help="new conversations per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write per-turn results here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args))
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "turns": [asdict(t) for t in result.turns],
                    "reused_fraction": result.reused_fraction(),
                    "decision_shares": result.decision_shares(),
                    "wall_s": result.wall_s,
                },
                f,
                indent=1,
            )
    return 0
