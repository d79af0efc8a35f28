"""The dev stack's demo: multi-turn chats through the gateway, and where each prompt's KV came from."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

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
                user = " ".join(f"question {c}.{t} about item {i}" for i in range(60 * t))
                messages.append({"role": "user", "content": user})
                body = {
                    "model": "sim-model",
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
                    DemoTurn(conversation, t, prompt_tokens, ttft, decision, pulled, cached, computed, text)
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
            f"{t.conversation:<14}{t.turn:>5}{t.prompt_tokens:>8}{t.ttft_ms:>9.0f}  {t.decision:<28}"
            f"{t.pulled_tokens:>8}{t.prefill_cache_tokens:>9}{t.computed_tokens:>9}"
        )
    lines.append(
        "pulled: read from the decode engine over NIXL; P cache: the prefill engine's own prefix cache;\n"
        "computed: prefilled. The three add up to the prompt."
    )
    return "\n".join(lines)
