"""Turn-2 prefill latency on sim-engines: pull from D versus recompute, with real NIXL reads.

    python -m kvplane.bench.pull_recompute_bench --tokens 24000

Four engines run in this process at real speed (speedup 1, the calibrated
Qwen3-32B timing model): P, D and two more Ps without any cache. Turn 1 is
P then D; turn 2's prompt extends it. Printed per case: the P leg's latency
(its TTFT), the tokens pulled over NIXL and the READ time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from typing import Any

from kvplane.connector.simengine.engine import FinishInfo, GenerationRequest, SimEngine
from kvplane.connector.simengine.settings import SimEngineSettings


async def _leg(
    engine: SimEngine, prompt: list[int], max_tokens: int, kvp: dict[str, Any] | None
) -> FinishInfo:
    fin = None
    req = GenerationRequest(f"cmpl-{uuid.uuid4().hex}", tuple(prompt), max_tokens, True, kvp)
    async for ev in engine.generate(req):
        fin = ev.finish or fin
    assert fin is not None
    return fin


def _pulled(engine: SimEngine) -> tuple[float, float, float]:
    """(tokens pulled, READ seconds, READ count) so far."""
    get = engine.metrics.registry.get_sample_value
    labels = {"model_name": engine.settings.model, "engine": "0"}
    return (
        get("vllm:prompt_tokens_by_source_total", {**labels, "source": "external_kv_transfer"}) or 0.0,
        get("vllm:nixl_xfer_time_seconds_sum", labels) or 0.0,
        get("vllm:nixl_xfer_time_seconds_count", labels) or 0.0,
    )


async def run(
    tokens: int, output: int, new_tokens: int, bytes_per_block: int
) -> list[tuple[str, float, float, float]]:
    blocks = 4 * (tokens + output + new_tokens) // 16 + 64
    engines = [
        SimEngine(
            SimEngineSettings(
                engine_id=name,
                side_channel_port=0,
                num_blocks=blocks,
                bytes_per_block=bytes_per_block,
                decoder_kv_blocks_ttl=120,
            )
        )
        for name in ("p", "d", "p-cold", "p-recompute")
    ]
    p, d, cold, recompute = engines
    for e in engines:
        await e.start()
    try:
        rnd = random.Random(0)
        prompt = [rnd.randrange(300, 30000) for _ in range(tokens)]
        rows: list[tuple[str, float, float, float]] = []

        async def p_leg(label: str, engine: SimEngine, prompt: list[int], kvp: dict[str, Any]) -> FinishInfo:
            before = _pulled(engine)
            t0 = time.perf_counter()
            fin = await _leg(engine, prompt, 1, kvp)
            took = time.perf_counter() - t0
            after = _pulled(engine)
            rows.append((label, took, after[0] - before[0], after[1] - before[1]))
            return fin

        fresh: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        p1 = await p_leg("turn 1, P computes everything", p, prompt, fresh)
        d1 = await _leg(d, prompt, output, p1.kv_transfer_params)
        prompt2 = prompt + list(d1.output_token_ids) + [rnd.randrange(300, 30000) for _ in range(new_tokens)]
        assert d1.kv_transfer_params is not None
        handle = dict(d1.kv_transfer_params, do_remote_prefill=False)
        await p_leg("turn 2, P pulls D's tail (own cache)", p, prompt2, handle)
        # A second turn-1/turn-2 pair, so the cold P gets a live handle of its own.
        d2 = await _leg(d, prompt, output, (await _leg(p, prompt, 1, fresh)).kv_transfer_params)
        assert d2.kv_transfer_params is not None
        await p_leg(
            "turn 2, cold P pulls everything",
            cold,
            prompt2,
            dict(d2.kv_transfer_params, do_remote_prefill=False),
        )
        await p_leg("turn 2, cold P recomputes", recompute, prompt2, fresh)
        return rows
    finally:
        for e in engines:
            await e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24_000, help="turn-1 prompt tokens")
    ap.add_argument("--output", type=int, default=200, help="turn-1 output tokens")
    ap.add_argument("--new-tokens", type=int, default=300, help="tokens turn 2 adds")
    ap.add_argument("--bytes-per-block", type=int, default=16384)
    a = ap.parse_args()
    rows = asyncio.run(run(a.tokens, a.output, a.new_tokens, a.bytes_per_block))
    print(f"{'case':40s} {'P latency':>10s} {'pulled':>8s} {'READ':>9s}")
    for label, took, pulled, read_s in rows:
        print(f"{label:40s} {took * 1e3:8.0f}ms {pulled:8.0f} {read_s * 1e3:7.1f}ms")


if __name__ == "__main__":
    main()
