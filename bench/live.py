"""`kvplane bench`: a live benchmark against a running gateway (sim-engines or real vLLM).

It drives token-id conversations through the gateway's OpenAI API at a target
rate of new conversations, with a progress line, and reports:

- TTFT by decision (turns that pulled retained KV against turns that recomputed);
- the decision mix, and where the prefill engines' prompt tokens came from
  (pulled from D, P's own prefix cache, computed: their
  `vllm:prompt_tokens_by_source` metric, when the prefill URLs are given);
- the control plane's own cost per turn: the same first-turn request sent to
  the engines directly (P leg then D leg, no kvplane), interleaved with the
  gateway's first turns in the same run, compared by median TTFT;
- with `--direct-baseline` (on by default with `--start-stack`), a second phase
  run after the first: the same workload (same arrivals and prompt shapes,
  other token ids) sent straight to the engines by a client without reuse
  (P and D drawn at random per turn, which is what the example proxy's
  round-robin gives many independent clients; P's prefix cache as
  configured), and the later turns of both compared as ratios.

    kvplane bench --gateway http://127.0.0.1:8080 --api-key KEY \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    kvplane bench --start-stack --prefill-nodes 2 --decode-nodes 2 --prefix-cache
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import run_until_stopped, stopped

# The prefill engines' prompt-token sources (vLLM's `vllm:prompt_tokens_by_source` labels).
PULLED, CACHED, COMPUTED = "external_kv_transfer", "local_cache_hit", "local_compute"
# Prompt tokens a decode engine found in its own cache for a turn it served alone (prefill_on_decode).
DECODE_CACHED = "decode_cache_hit"
SOURCE_NAMES = {PULLED: "pulled from D", CACHED: "P's prefix cache", COMPUTED: "computed"}


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
    # Prompt tokens the prefill engines took from each source during the run (summed over engines).
    sources: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def pulled_tokens(self) -> float:
        return self.sources.get(PULLED, 0.0)

    @property
    def prompt_tokens_on_prefill(self) -> float:
        return sum(self.sources.values())

    def gateway_turns(self) -> list[TurnResult]:
        return [t for t in self.turns if t.via == "gateway"]

    def later_turns(self, via: str) -> list[TurnResult]:
        return [t for t in self.turns if t.via == via and t.turn_index > 0]

    def decision_shares(self) -> dict[str, float]:
        turns = self.gateway_turns()
        counts = Counter(t.decision for t in turns)
        return {k: v / max(1, len(turns)) for k, v in counts.items()}

    def source_share(self, source: str) -> float:
        total = self.prompt_tokens_on_prefill
        return self.sources.get(source, 0.0) / total if total else 0.0

    def reused_fraction(self) -> float:
        """Prompt tokens P pulled over all prompt tokens P saw (both from P's metrics)."""
        return self.source_share(PULLED)


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


async def stream_turn(
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


def synthetic_ids(seed: int, n: int) -> list[int]:
    """`n` token ids, a pure function of `seed`: the text of a synthetic chat's turn."""
    return [(seed * 7919 + i * 31) % 29_000 + 300 for i in range(n)]


async def token_chat(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    *,
    seed: int,
    turns: int,
    prompt_tokens: int,
    user_tokens: int,
    max_tokens: int,
    model: str,
) -> AsyncIterator[tuple[str, float, list[int]]]:
    """One chat in token ids: each turn's prompt is the last one, its output and new user ids.

    Yields each turn's decision header, TTFT (ms) and output ids, as `stream_turn` returns them.
    """
    prompt = synthetic_ids(seed, prompt_tokens)
    for turn in range(turns):
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        decision, ttft, output = await stream_turn(session, url, body, headers)
        yield decision, ttft, output
        prompt = [*prompt, *output, *synthetic_ids(seed * 31 + turn + 1, user_tokens)]


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
    _, ttft_d, output = await stream_turn(
        session, f"{decode}/v1/completions", {**body, "kv_transfer_params": params}, {}
    )
    return (d_started - started) * 1e3 + ttft_d, output


async def prompt_token_sources(session: aiohttp.ClientSession, prefills: Sequence[str]) -> dict[str, float]:
    """Prompt tokens by source, summed over the prefill engines, so far."""
    sources: dict[str, float] = {}
    for url in prefills:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                labels, _, value = line.rpartition(" ")
                source = labels.partition('source="')[2].partition('"')[0]
                sources[source] = sources.get(source, 0.0) + float(value)
    return sources


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


def _urls(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) and value else [u for u in value if u]


# Sends one turn (conversation name, turn index, request body) and returns the decision, TTFT (ms)
# and the output ids.
SendTurn = Callable[[str, int, dict[str, Any]], Awaitable[tuple[str, float, list[int]]]]


async def _conversations(
    workload: Workload,
    model: str,
    via: str,
    send: SendTurn,
    result: LiveResult,
    *,
    token_salt: str = "",
    before_turn: Callable[[str, int, list[int], dict[str, Any]], Awaitable[None]] | None = None,
) -> None:
    """Runs the workload's conversations through `send`, appending each turn to `result`.

    Arrivals and prompt lengths depend only on the seed; `token_salt` changes
    the token ids alone, so two phases of one run see the same shapes without
    warming each other's caches.
    """
    rng = random.Random(workload.seed)
    started = time.perf_counter()

    async def conversation(index: int, crng_seed: float) -> None:
        crng = random.Random(f"{token_salt}{crng_seed}")
        name = f"bench-{workload.seed}{token_salt}-{index}"
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
            if before_turn is not None:
                await before_turn(name, turn, prompt, body)
            sent = time.perf_counter() - started
            decision, ttft, out = await send(name, turn, body)
            result.turns.append(TurnResult(name, turn, len(prompt), len(out), decision, ttft, via, sent))
            prompt = prompt + out + [crng.randrange(1000, 30000) for _ in range(workload.user_tokens)]

    tasks = []
    for i in range(workload.conversations):
        tasks.append(asyncio.create_task(conversation(i, rng.random())))
        await asyncio.sleep(rng.expovariate(workload.rate))  # Poisson arrivals of conversations
    await asyncio.gather(*tasks)
    result.wall_s = time.perf_counter() - started


async def drive(
    gateway: str,
    api_key: str,
    workload: Workload,
    *,
    prefill: str | Sequence[str] = "",
    decode: str | Sequence[str] = "",
    model: str = DEMO_MODEL,
    progress: bool = False,
) -> LiveResult:
    """Runs the workload through the gateway.

    With prefill and decode URLs, each conversation's first turn is also sent
    straight to the first P and D (other tokens, same length), interleaved, to
    measure the control plane's cost; and the prefill engines' token sources
    are read before and after.
    """
    prefills, decodes = _urls(prefill), _urls(decode)
    direct = bool(prefills and decodes)
    result = LiveResult()
    bar = _Progress(workload.conversations * (workload.turns + (1 if direct else 0)), progress)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await prompt_token_sources(session, prefills)

        probe_tokens: list[int] = []

        async def first_turn_direct(name: str, turn: int, prompt: list[int], body: dict[str, Any]) -> None:
            if not (direct and turn == 0):
                return
            # The no-kvplane cost of a first turn, on the same engines: a prompt of the same
            # length but other tokens, so neither run warms the other's cache.
            rng = random.Random(name)
            other = [rng.randrange(1000, 30000) for _ in range(len(prompt))]
            ttft, out = await _direct_turn(session, prefills[0], decodes[0], {**body, "prompt": other})
            result.turns.append(TurnResult(name, 0, len(other), len(out), "direct", ttft, "direct"))
            probe_tokens.append(len(other))
            bar.tick()

        async def send(name: str, turn: int, body: dict[str, Any]) -> tuple[str, float, list[int]]:
            headers = {"Authorization": f"Bearer {api_key}", "X-Conversation-Id": name}
            answer = await stream_turn(session, f"{gateway}/v1/completions", body, headers)
            bar.tick()
            return answer

        await _conversations(workload, model, "gateway", send, result, before_turn=first_turn_direct)
        after = await prompt_token_sources(session, prefills)
    result.sources = {k: after[k] - before.get(k, 0.0) for k in after}
    if COMPUTED in result.sources:
        # The first-turn probes are fresh random tokens, all computed on the first P: they are
        # not the gateway's turns.
        result.sources[COMPUTED] -= sum(probe_tokens)
    return result


async def drive_direct(
    prefill: Sequence[str],
    decode: Sequence[str],
    workload: Workload,
    *,
    model: str = DEMO_MODEL,
    progress: bool = False,
) -> LiveResult:
    """The same workload sent straight to the engines by a client without reuse.

    Each turn goes to a P and a D drawn at random (seeded): what round-robin
    (vLLM's example proxy) gives under traffic from many independent clients.
    A strict rotation would flatter or punish it by parity alone: with an even
    number of conversations in lockstep, every conversation would meet its own
    P again each turn. P computes what its own prefix cache lacks, D reads it
    from P, and nothing D held from an earlier turn is used. Token ids differ
    from the gateway phase's (same shapes and arrivals).
    """
    prefills, decodes = _urls(prefill), _urls(decode)
    if not (prefills and decodes):
        raise ValueError("the direct baseline needs at least one prefill and one decode URL")
    result = LiveResult()
    bar = _Progress(workload.conversations * workload.turns, progress)
    picks = random.Random(f"direct-{workload.seed}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await prompt_token_sources(session, prefills)

        async def send(name: str, turn: int, body: dict[str, Any]) -> tuple[str, float, list[int]]:
            ttft, out = await _direct_turn(session, picks.choice(prefills), picks.choice(decodes), body)
            bar.tick()
            return "direct", ttft, out

        await _conversations(workload, model, "direct", send, result, token_salt="direct")
        after = await prompt_token_sources(session, prefills)
    result.sources = {k: after[k] - before.get(k, 0.0) for k in after}
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


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def comparison_report(kvplane: LiveResult, direct: LiveResult) -> str:
    """Later turns through kvplane against the direct client without reuse, as ratios."""
    ours = [t.ttft_ms for t in kvplane.later_turns("gateway")]
    theirs = [t.ttft_ms for t in direct.later_turns("direct")]
    lines = [
        "later turns: kvplane against a direct client without reuse (P and D at random, run after, "
        "same arrivals and prompt lengths)",
        "",
        "| | kvplane | direct, no reuse | kvplane / direct |",
        "|---|---:|---:|---:|",
    ]
    for name, q in (("TTFT p50 ms", 0.5), ("TTFT p99 ms", 0.99)):
        a, b = _pct(ours, q), _pct(theirs, q)
        lines.append(f"| {name} ({len(ours)} vs {len(theirs)} turns) | {a:.1f} | {b:.1f} | {_ratio(a, b)} |")
    for source in (PULLED, CACHED, COMPUTED):
        a, b = kvplane.sources.get(source, 0.0), direct.sources.get(source, 0.0)
        lines.append(
            f"| prompt tokens {SOURCE_NAMES[source]} | {a:,.0f} ({kvplane.source_share(source):.1%}) "
            f"| {b:,.0f} ({direct.source_share(source):.1%}) | {_ratio(a, b)} |"
        )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> tuple[LiveResult, LiveResult | None]:
    workload = Workload(
        conversations=args.conversations,
        turns=args.turns,
        first_tokens=args.first_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        rate=args.rate,
        seed=args.seed,
    )
    progress = not args.quiet

    async def both(
        gateway: str, api_key: str, prefills: list[str], decodes: list[str]
    ) -> tuple[LiveResult, LiveResult | None]:
        ours = await drive(
            gateway, api_key, workload, prefill=prefills, decode=decodes, model=args.model, progress=progress
        )
        baseline = args.direct_baseline if args.direct_baseline is not None else args.start_stack
        if not (baseline and prefills and decodes):
            return ours, None
        return ours, await drive_direct(prefills, decodes, workload, model=args.model, progress=progress)

    if not args.start_stack:
        return await both(args.gateway, args.api_key, _split(args.prefill), _split(args.decode))
    from kvplane.services.devstack.stack import DEMO_API_KEY, start_stack

    stack = await start_stack(
        progress=lambda m: print(f"==> {m}", file=sys.stderr),
        prefill_prefix_caching=args.prefix_cache,
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
    )
    try:
        return await both(stack.gateway_url, DEMO_API_KEY, stack.prefill_urls, stack.decode_urls)
    finally:
        stack.stop()


def _split(urls: str) -> list[str]:
    return [u.strip() for u in urls.split(",") if u.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvplane bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--api-key", default="dev-key")
    parser.add_argument(
        "--prefill",
        default="",
        help="prefill engine URLs, comma-separated: token sources, direct baseline",
    )
    parser.add_argument("--decode", default="", help="decode engine URLs, comma-separated: direct baseline")
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--start-stack", action="store_true", help="start a dev stack and benchmark it")
    parser.add_argument(
        "--prefill-nodes", type=int, default=2, help="with --start-stack: prefill sim-engines"
    )
    parser.add_argument("--decode-nodes", type=int, default=2, help="with --start-stack: D engines")
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --start-stack: P keeps its prefix cache, as vLLM does by default",
    )
    parser.add_argument(
        "--direct-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the gateway phase, run the workload straight to the engines without reuse and compare "
        "later turns (default: on with --start-stack)",
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
    outcome = run_until_stopped(_run(args))
    if outcome is None:
        return stopped()
    result, direct = outcome
    print(report(result))
    if direct is not None:
        print()
        print(comparison_report(result, direct))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "turns": [asdict(t) for t in result.turns + (direct.turns if direct else [])],
                    "reused_fraction": result.reused_fraction(),
                    "sources": result.sources,
                    "direct_sources": direct.sources if direct else {},
                    "decision_shares": result.decision_shares(),
                    "wall_s": result.wall_s,
                },
                f,
                indent=1,
            )
    return 0
