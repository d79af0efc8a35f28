"""D admits a turn when P has answered it, as the gateway and vLLM's proxies send the D leg then."""

from __future__ import annotations

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, simulator_for
from kvplane.bench.workloads.turns import Turn

COSTS = SimCosts()
LONG = Turn(0.0, "long", 0, 20_000, 10)
SHORT = Turn(0.001, "short", 0, 1_000, 50)
# One decode node with room for the long turn's KV or the short one's, not both at once.
CAPACITY = COSTS.kv_bytes(LONG.context_tokens) + COSTS.kv_bytes(SHORT.context_tokens) // 2


def _ttfts(pressure: str) -> dict[str, float]:
    config = SimConfig(
        cluster=ClusterSpec(
            prefill_nodes=2, decode_nodes=1, decode_kv_capacity_bytes=CAPACITY, prefill_cache_bytes=0
        ),
        pressure=pressure,
    )
    result = simulator_for(BASELINES["no-reuse"], config).run([LONG, SHORT])
    by_prompt = dict(zip(result.prompt_tokens, result.ttft_s, strict=True))
    return {"long": by_prompt[LONG.prompt_tokens], "short": by_prompt[SHORT.prompt_tokens]}


def test_the_turn_whose_prefill_ends_first_gets_decode_memory_first() -> None:
    ttft = _ttfts("wait")
    step = COSTS.decode_step_s(1)  # D's first step, alone in its batch
    # The short turn, routed second, reached D first: D had not reserved the long one at routing.
    assert ttft["short"] == pytest.approx(COSTS.prefill_s(SHORT.prompt_tokens) + step)
    # The long turn found D full when its prefill ended, and waited for the short one's decode.
    short_done = SHORT.arrival_s + ttft["short"] - step + COSTS.decode_s(SHORT.output_tokens, 1)
    assert ttft["long"] == pytest.approx(short_done + step - LONG.arrival_s)
    assert ttft["long"] > COSTS.prefill_s(LONG.prompt_tokens)


def test_an_evicting_decode_node_makes_room_when_the_turn_reaches_it() -> None:
    ttft = _ttfts("evict")
    # Nothing is retained to evict: both run at once, the later one overcommitted, neither waits
    # (the long one's first step is in a batch of two).
    assert ttft["short"] == pytest.approx(COSTS.prefill_s(SHORT.prompt_tokens) + COSTS.decode_step_s(1))
    assert ttft["long"] == pytest.approx(COSTS.prefill_s(LONG.prompt_tokens) + COSTS.decode_step_s(2))
