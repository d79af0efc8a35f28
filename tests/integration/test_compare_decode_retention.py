"""Before each block, the comparison runs D as the front's users run it: with vLLM's
bidirectional_kv_xfer on only for the fronts that carry D's handle into the next turn. Without
that, the turns of a front that never reads D's handle pin D's memory until the TTL, and at 96
conversations vllm-router's turns stalled behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvplane.bench.compare_fronts import (
    EXAMPLE_PROXY,
    KVPLANE,
    KVPLANE_HOST_TIER,
    VLLM_ROUTER,
    Front,
    HttpFront,
    ZeroHopFront,
)
from kvplane.bench.compare_run import Engines, prepare
from kvplane.connector.simengine.app import SimEngineServer
from kvplane.services.common.runtime.ports import free_port
from tests.support.simengine import sim


@pytest.fixture
async def decode() -> AsyncIterator[SimEngineServer]:
    server = SimEngineServer(sim(role="decode", http_port=free_port(), side_channel_port=free_port()))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_d_retains_turns_only_for_the_fronts_that_carry_its_handle(decode: SimEngineServer) -> None:
    url = decode.http_url
    engines = Engines(prefills=(), decodes=(url,), etcd_url="", gateway_urls={}, pids={})
    fronts: list[tuple[Front, bool]] = [
        (HttpFront(VLLM_ROUTER, [], {}, decode_retention=False), False),
        (HttpFront(EXAMPLE_PROXY, [], {}), True),
        (ZeroHopFront("zero-hop", [], [url], reuse=False), False),
        (ZeroHopFront("zero-hop-reuse", [], [url], reuse=True), True),
    ]
    async with aiohttp.ClientSession() as session:
        for front, retains in fronts:
            await prepare(session, engines, front)
            async with session.get(f"{url}/sim/state") as resp:
                assert (await resp.json())["bidirectional"] is retains, front.name
            assert decode.engine.bidirectional is retains


async def test_d_moves_handles_to_its_host_tier_only_in_the_blocks_of_the_front_that_asks(
    decode: SimEngineServer,
) -> None:
    url = decode.http_url
    engines = Engines(prefills=(), decodes=(url,), etcd_url="", gateway_urls={}, pids={})
    fronts: list[tuple[Front, bool]] = [
        (HttpFront(KVPLANE_HOST_TIER, [], {}, decode_host_tier=True), True),
        (HttpFront(KVPLANE, [], {}), False),
        (ZeroHopFront("zero-hop-reuse", [], [url], reuse=True), False),
    ]
    async with aiohttp.ClientSession() as session:
        for front, moves in fronts:
            await prepare(session, engines, front)
            async with session.get(f"{url}/sim/state") as resp:
                assert (await resp.json())["host_tier"] is moves, front.name
            assert decode.engine.retention.host_tier_enabled is moves
