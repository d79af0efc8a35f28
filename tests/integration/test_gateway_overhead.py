"""What the gateway adds to a turn: the same single-turn requests through the gateway and straight to the
engines (P leg, then the streamed D leg), interleaved, on one stack. Prints the figures; run with -s.

    .venv/bin/pytest -q -s -m slow tests/integration/test_gateway_overhead.py
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.gateway_stack import MODEL, GatewayStack, gateway_stack

# Every turn leaves D a retained handle until its TTL: 2 x 30 turns of 63 blocks fit D's 4,096 blocks.
TURNS = 30
PROMPT_TOKENS = 1000
MAX_TOKENS = 16


@pytest.fixture(scope="module")
async def stack(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(etcd, f"/kvplane-gwo/{uuid.uuid4().hex}/", tmp_path_factory.mktemp("gwo")) as s:
        yield s


def _body(seed: int) -> dict[str, Any]:
    prompt = [(seed * 7919 + i * 31) % 29_000 + 300 for i in range(PROMPT_TOKENS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}


async def _stream(stack: GatewayStack, url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    """Seconds to the first token; reads the stream to its end."""
    start = time.perf_counter()
    first = 0.0
    async with stack.session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not first and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    return first


async def _through_gateway(stack: GatewayStack, seed: int) -> float:
    headers = stack.headers("acme", f"overhead-{uuid.uuid4().hex}")
    return await _stream(stack, stack.gateway.url + "/v1/completions", _body(seed), headers)


async def _direct(stack: GatewayStack, seed: int) -> float:
    start = time.perf_counter()
    body = _body(seed)
    p_body = dict(body, stream=False, max_tokens=1, kv_transfer_params=fresh_prefill_params())
    # Straight to P, not through the test's fault proxy.
    p_url = stack.prefill.url + "/v1/completions"
    async with stack.session.post(p_url, json=p_body) as resp:
        p_params = json.loads(await resp.read())["kv_transfer_params"]
    d_body = dict(body, kv_transfer_params=p_params)
    return (
        time.perf_counter() - start + await _stream(stack, stack.decode.url + "/v1/completions", d_body, {})
    )


@pytest.mark.slow
async def test_gateway_added_latency(stack: GatewayStack) -> None:
    gateway, direct = [], []
    for i in range(TURNS):
        gateway.append(await _through_gateway(stack, 2 * i))
        direct.append(await _direct(stack, 2 * i + 1))
    g, d = statistics.median(gateway), statistics.median(direct)
    print(
        f"\nTTFT over {TURNS} single turns of {PROMPT_TOKENS} tokens: gateway median {g * 1000:.1f} ms,"
        f" direct median {d * 1000:.1f} ms, added {(g - d) * 1000:.1f} ms"
        f" (p90 gateway {sorted(gateway)[int(TURNS * 0.9)] * 1000:.1f} ms,"
        f" direct {sorted(direct)[int(TURNS * 0.9)] * 1000:.1f} ms)"
    )
    # Generous: a shared machine; the figure is what the print says.
    assert g - d < 0.25
