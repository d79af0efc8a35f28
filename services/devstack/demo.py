"""The dev stack's demo: multi-turn chats through the gateway, and where each prompt's KV came from.

While P's own prefix cache holds a conversation's history, routing lets P use it, pulls only what
beats recomputing, and (once it sees that P keeps the history) tells D to keep no copy; before the
second turn of the last chat the demo resets P's prefix cache (vLLM's `/reset_prefix_cache`, as
an engine restart or eviction would leave it), so that turn's history is pulled from D, which
retained the first turn. Each decision is printed with what it means.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.stack import DEMO_API_KEY, Stack


@dataclass(frozen=True)
class DemoTurn:
    conversation: str
    turn: int
    prompt_tokens: int
    ttft_ms: float
    decision: str
    # Where the prefill engine got the prompt's KV: pulled + prefill_cache + computed = prompt_tokens.
    pulled_tokens: int
    prefill_cache_tokens: int
    computed_tokens: int
    text: str
    # The demo reset P's prefix cache just before this turn.
    reset_before: bool = False


# What each decision the gateway reports (`x-kvplane-decision`) means.
DECISION_MEANINGS = {
    "pull": "P read the conversation's retained KV from D over NIXL",
    "pull_prefix": "P read the verified part of D's retained KV, and computed the rest",
    "recompute_no_handle": "nothing retained yet (a first turn)",
    "recompute_below_threshold": "P's own prefix cache holds nearly all of it: too little left to pull",
    "recompute_cost": "recomputing the missing part is faster than pulling it",
    "recompute_expiring": "D's retained KV expires too soon to read",
    "recompute_holder_down": "the engine holding the KV is gone, restarted or draining",
    "recompute_prefix_mismatch": "the prompt does not continue what D retains",
    "recompute_contended": "another turn of the conversation holds the KV, or etcd is unreachable",
    "prefill_on_decode": "the D holding the conversation's KV prefilled the turn itself, with no P leg",
}


async def _reset_prefix_cache(session: aiohttp.ClientSession, engine_url: str) -> bool:
    """vLLM's /reset_prefix_cache on P: refused while blocks are in use, so tried a few times."""
    for _ in range(50):
        async with session.post(f"{engine_url}/reset_prefix_cache") as resp:
            if resp.status == 200 and (await resp.json()).get("success"):
                # The engine's AllBlocksCleared event reaches routing through its node agent within
                # a few hundred ms (coalesced every 100 ms): the next turn is routed after that.
                await asyncio.sleep(1.0)
                return True
        await asyncio.sleep(0.1)
    return False


async def run_demo(
    stack: Stack, *, conversations: int = 2, turns: int = 3, max_tokens: int = 96
) -> list[DemoTurn]:
    """Multi-turn chats through the gateway; one record per turn.

    P's own prefix cache holds each turn's prompt, so all the next turn could pull is D's
    answer; routing pulls it only where the transfer beats recomputing it, and otherwise
    lets P recompute that tail beside its cache hit.
    """
    out: list[DemoTurn] = []
    headers = {"Authorization": f"Bearer {DEMO_API_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for c in range(conversations):
            conversation = f"demo-{c}"
            messages = [{"role": "system", "content": "You are a terse assistant."}]
            for t in range(1, turns + 1):
                # The second turn: after it, routing knows P keeps the history and D keeps no copy.
                reset = c == conversations - 1 and t == 2
                if reset:
                    reset = await _reset_prefix_cache(session, stack.prefill_url)
                user = " ".join(f"question {c}.{t} about item {i}" for i in range(60 * t))
                messages.append({"role": "user", "content": user})
                body = {
                    "model": DEMO_MODEL,
                    "messages": messages,
                    "max_tokens": max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                before = await _prompt_sources(session, stack.prefill_url)
                started = time.perf_counter()
                ttft = 0.0
                text = ""
                usage: dict[str, int] = {}
                async with session.post(
                    f"{stack.gateway_url}/v1/chat/completions",
                    json=body,
                    headers={"X-Conversation-Id": conversation},
                ) as resp:
                    if resp.status != 200:
                        raise RuntimeError(
                            f"turn {t} of {conversation}: HTTP {resp.status}: {await resp.text()}"
                        )
                    decision = resp.headers.get("x-kvplane-decision", "?")
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            piece = (choice.get("delta") or {}).get("content") or ""
                            if piece and not ttft:
                                ttft = (time.perf_counter() - started) * 1e3
                            text += piece
                        usage = chunk.get("usage") or usage
                after = await _prompt_sources(session, stack.prefill_url)
                pulled = int(after["external_kv_transfer"] - before["external_kv_transfer"])
                cached = int(after["local_cache_hit"] - before["local_cache_hit"])
                computed = int(after["local_compute"] - before["local_compute"])
                prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
                messages.append({"role": "assistant", "content": text})
                out.append(
                    DemoTurn(
                        conversation, t, prompt_tokens, ttft, decision, pulled, cached, computed, text, reset
                    )
                )
    return out


async def _prompt_sources(session: aiohttp.ClientSession, engine_url: str) -> dict[str, float]:
    """The prefill engine's prompt tokens by source (vLLM's metric), summed over labels."""
    async with session.get(f"{engine_url}/metrics") as resp:
        text = await resp.text()
    totals = {"external_kv_transfer": 0.0, "local_compute": 0.0, "local_cache_hit": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            labels, _, value = line.rpartition(" ")
            for source in totals:
                if f'source="{source}"' in labels:
                    totals[source] += float(value)
    return totals


def demo_table(turns: Sequence[DemoTurn]) -> str:
    """The demo's table: per turn, where the prefill engine got each prompt token's KV."""
    header = ("conversation", "turn", "prompt", "TTFT ms", "decision", "pulled", "P cache", "computed")
    lines = ["{:<14}{:>5}{:>8}{:>9}  {:<28}{:>8}{:>9}{:>9}".format(*header)]
    for t in turns:
        lines.append(
            f"{t.conversation:<14}{t.turn:>4}{'*' if t.reset_before else ' '}{t.prompt_tokens:>8}"
            f"{t.ttft_ms:>9.0f}  {t.decision:<28}"
            f"{t.pulled_tokens:>8}{t.prefill_cache_tokens:>9}{t.computed_tokens:>9}"
        )
    lines.append(
        "pulled: read from the decode engine over NIXL; P cache: the prefill engine's own prefix cache;\n"
        "computed: prefilled. The three add up to the prompt."
    )
    if any(t.reset_before for t in turns):
        lines.append(
            "*: P's prefix cache was reset just before this turn (as a restart or eviction leaves it)."
        )
    lines.append("decisions:")
    for decision in dict.fromkeys(t.decision for t in turns):
        lines.append(f"  {decision}: {DECISION_MEANINGS.get(decision, 'see the README glossary')}")
    return "\n".join(lines)
