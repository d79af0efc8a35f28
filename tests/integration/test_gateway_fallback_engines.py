"""The gateway's fallback engines while routing is unreachable: turns spread over every configured
P and D, and an engine whose leg fails is skipped by the turn's retry and by the turns after it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from pydantic import SecretStr

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from tests.integration.test_gateway_front import KEY, ScriptedEngine
from tests.support.gateway_stack import metric_sum

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@dataclass
class Fleet:
    gateway: Gateway
    prefill: list[ScriptedEngine]
    decode: list[ScriptedEngine]
    session: aiohttp.ClientSession

    async def turn(self, conversation: str) -> aiohttp.ClientResponse:
        resp = await self.session.post(
            self.gateway.url + "/v1/chat/completions",
            json=dict(CHAT),
            headers={"Authorization": f"Bearer {KEY}", "X-Conversation-Id": conversation},
        )
        await resp.read()
        return resp

    async def metric(self, name: str, **labels: str) -> float:
        async with self.session.get(self.gateway.url + "/metrics") as resp:
            return metric_sum(await resp.text(), name, **labels)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    prefill = [ScriptedEngine("prefill") for _ in range(2)]
    decode = [ScriptedEngine("decode") for _ in range(2)]
    for engine in prefill + decode:
        await engine.start()
    gateway = Gateway(
        GatewaySection(
            listen=f"127.0.0.1:{free_port()}",
            routing=[f"127.0.0.1:{free_port()}"],  # nothing listens there
            routing_timeout_s=0.2,
            api_keys=[GatewayKey(token=SecretStr(KEY), tenant="acme")],
            # Two spellings the settings accept: a comma-separated string and a list.
            fallback_prefill_url=",".join(e.url for e in prefill),  # type: ignore[arg-type]
            fallback_decode_url=[e.url + "/" for e in decode],
            fallback_suspect_s=600,  # outlasts the test: a skipped engine stays skipped
            prefill_timeout_s=2.0,
        ),
        Telemetry.disabled("kvplane-gateway"),
    )
    await gateway.start()
    session = aiohttp.ClientSession()
    try:
        yield Fleet(gateway, prefill, decode, session)
    finally:
        await session.close()
        await gateway.stop()
        for engine in prefill + decode:
            await engine.stop()


def _served(engines: list[ScriptedEngine]) -> list[int]:
    return [len([s for s in e.seen if s[0].startswith("/v1/")]) for e in engines]


async def test_turns_spread_over_every_fallback_engine(fleet: Fleet) -> None:
    for i in range(4):
        resp = await fleet.turn(f"c{i}")
        assert resp.status == 200 and resp.headers["x-kvplane-decision"] == "fallback"
    assert _served(fleet.prefill) == [2, 2]
    assert _served(fleet.decode) == [2, 2]


async def test_a_dead_fallback_prefill_is_retried_elsewhere_and_then_skipped(fleet: Fleet) -> None:
    dead = fleet.prefill[0]
    await dead.stop()  # its port now refuses connections, as a crashed engine's does
    for i in range(6):
        resp = await fleet.turn(f"c{i}")
        assert resp.status == 200, await resp.text()
    # The first turn met the dead P once and was retried on the other; no later turn tried it.
    assert await fleet.metric("kvplane_gateway_retries_total", reason="prefill_unreachable") == 1
    assert _served(fleet.prefill)[1] == 6
    assert sum(_served(fleet.decode)) == 6


async def test_a_dead_fallback_decode_is_not_the_retrys_engine_nor_chosen_again(fleet: Fleet) -> None:
    fleet.decode[0].drop_next = 1_000  # every leg to it dropped, as a dying engine's are
    for i in range(6):
        resp = await fleet.turn(f"c{i}")
        assert resp.status == 200, await resp.text()
    assert await fleet.metric("kvplane_gateway_retries_total", reason="decode_unreachable") == 1
    assert _served(fleet.decode) == [1, 6]
