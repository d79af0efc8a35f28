"""Release on demand on the sim-engine: real etcd, the real metadata and eviction services, real engines.

A decode engine full of retained handles gets a request that cannot fit. Its
node agent reports the demand on the command stream; the eviction leader
releases the engine's least valuable handles (oldest first among equals),
only as many as the request needs, each through the fenced transaction, and
the request runs. A handle that has been checked out is never among them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import settings_for, tenant_headers
from tests.support.eviction_nodes import coordinator_of
from tests.support.polling import eventually
from tests.support.simengine import MODEL, Engine, d_leg, engines, free_port, loads, p_leg, sim, tokens

TENANT = "acme"
# D holds 64 blocks of 16 tokens. Three 200 + 100 token turns retain 19 blocks each (57), so a
# 200-token request (13 blocks) finds only 7 free and must wait for memory.
D_BLOCKS = 64


@pytest.fixture
async def control_plane(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    from kvplane.services.eviction.app import install as install_eviction
    from kvplane.services.metadata.app import install as install_metadata

    # Only the demand plugin, and rounds every 30 s: a release here is the demand path's.
    eviction = {"policy": {"policies": [{"name": "demand"}]}, "evaluate_interval_s": 30.0, "lease_ttl_s": 5}
    process = ServiceProcess(
        settings_for(etcd, prefix, eviction=eviction),
        [install_metadata, install_eviction],
        Telemetry.disabled(),
    )
    await process.start()
    try:

        async def leads() -> bool:
            return coordinator_of(process).is_leader

        await eventually(leads, what="the eviction leader")
        yield process
    finally:
        await process.stop()


@contextlib.asynccontextmanager
async def pd_pair(target: str, log_dir: Path) -> AsyncIterator[tuple[Engine, Engine]]:
    common: dict[str, Any] = {"control_plane": target, "load_interval_s": 0.2, "kv_wait_timeout_s": 30}
    specs = {
        "P": sim(role="prefill", node_id="p0", side_channel_port=free_port(), **common),
        "D": sim(role="decode", node_id="d0", side_channel_port=free_port(), num_blocks=D_BLOCKS, **common),
    }
    stack = contextlib.ExitStack()
    try:
        cluster = await asyncio.to_thread(stack.enter_context, engines(log_dir, specs))
        yield cluster["P"], cluster["D"]
    finally:
        await asyncio.to_thread(stack.close)


async def retained_turn(p: Engine, d: Engine, conversation: str, seed: int) -> dict[str, Any]:
    """One routed turn: D retains the conversation's KV and publishes its handle."""
    prompt = tokens(seed, 200)
    p_params = (await asyncio.to_thread(p_leg, p, prompt, None))["kv_transfer_params"]
    d_params = dict(p_params, kvplane_tenant=TENANT, kvplane_conversation=conversation)
    out = await asyncio.to_thread(d_leg, d, prompt, d_params, 100)
    handle: dict[str, Any] = out["kv_transfer_params"]
    handle["prompt"] = prompt + out["choices"][0]["token_ids"]
    return handle


async def published(channel: grpc.aio.Channel, conversation: str) -> bool:
    try:
        await metadata_pb2_grpc.MetadataServiceStub(channel).GetHandle(
            metadata_pb2.GetHandleRequest(tenant=TENANT, conversation=conversation),
            metadata=tenant_headers(TENANT),
        )
        return True
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise


async def fill(p: Engine, d: Engine, channel: grpc.aio.Channel) -> list[dict[str, Any]]:
    """Three retained, published handles on D, oldest first."""
    handles = []
    for i in range(3):
        handles.append(await retained_turn(p, d, f"conv-{i}", 100 + i))
        await eventually(lambda i=i: published(channel, f"conv-{i}"), what=f"conv-{i} published")  # type: ignore[misc]
    free = (await asyncio.to_thread(d.state))["load"]["free_kv_blocks"]
    assert free < 13, "the next request must not fit without a release"
    return handles


def local_request(d: Engine, seed: int) -> dict[str, Any]:
    """A request on D that needs 13 blocks for its prompt."""
    return d.post(
        "/v1/completions",
        {"model": MODEL, "prompt": tokens(seed, 200), "max_tokens": 8, "ignore_eos": True},
        timeout=60,
    )


async def test_a_waiting_request_on_a_full_decode_node_gets_the_least_valuable_handles_blocks(
    control_plane: ServiceProcess, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{control_plane.grpc_port}"
    async with grpc.aio.insecure_channel(target) as channel, pd_pair(target, tmp_path) as (p, d):
        handles = await fill(p, d, channel)
        early_before = await asyncio.to_thread(d.metric, "kvplane_sim_retained_frees_total", reason="early")

        answer = await asyncio.to_thread(local_request, d, 7)

        assert answer["choices"][0]["finish_reason"] == "length"
        # The oldest handle went (13 - 7 free = 6 blocks wanted; it holds 19), and nothing more.
        assert not await published(channel, "conv-0")
        assert await published(channel, "conv-1") and await published(channel, "conv-2")
        held = await asyncio.to_thread(d.retained_ids)
        assert handles[0]["remote_request_id"] not in held
        assert {h["remote_request_id"] for h in handles[1:]} <= held
        early = await asyncio.to_thread(d.metric, "kvplane_sim_retained_frees_total", reason="early")
        assert early - early_before == 1
        coordinator = coordinator_of(control_plane)
        assert coordinator.metrics.releases.labels("node_budget", "demand")._value.get() == 1


async def test_a_checked_out_handle_is_never_freed_for_a_demand(
    control_plane: ServiceProcess, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{control_plane.grpc_port}"
    async with grpc.aio.insecure_channel(target) as channel, pd_pair(target, tmp_path) as (p, d):
        handles = await fill(p, d, channel)
        # conv-0, the first candidate, is checked out for its next turn before D runs short.
        checked_out = await metadata_pb2_grpc.MetadataServiceStub(channel).CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(tenant=TENANT, conversation="conv-0"),
            metadata=tenant_headers(TENANT),
        )
        assert checked_out.handle.vllm.remote_request_id == handles[0]["remote_request_id"]

        answer = await asyncio.to_thread(local_request, d, 8)

        assert answer["choices"][0]["finish_reason"] == "length"
        held = await asyncio.to_thread(d.retained_ids)
        assert handles[0]["remote_request_id"] in held, "the checked-out handle's blocks are still there"
        assert handles[1]["remote_request_id"] not in held, "the next least valuable went instead"
        assert not await published(channel, "conv-1") and await published(channel, "conv-2")
        # And the turn it was checked out for reads it.
        pulled = await asyncio.to_thread(loads, p, "pulled")
        prompt = handles[0]["prompt"] + tokens(9, 40)
        d_handle = {k: v for k, v in handles[0].items() if k != "prompt"}
        await asyncio.to_thread(p_leg, p, prompt, d_handle)
        assert await asyncio.to_thread(loads, p, "pulled") == pulled + 1
