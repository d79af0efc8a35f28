"""Routing in the gateway's own process (`colocated_routing.py`), against a real etcd.

The gateway's client calls the process's routing servicer directly. What it gets must be what a
call off the wire gets from the same replica: the same decisions, the same checks of the request
and the same status codes, the handle checked out once; and the process is still a routing
replica that other callers reach over gRPC.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from kvplane.services.client import RoutingClient
from kvplane.services.common.model.handles import KEY_TENANT
from kvplane.services.common.runtime.server import _PRINCIPAL
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.gateway.colocated_routing import IN_PROCESS_TARGET, ColocatedRouting
from kvplane.services.process import ServiceProcess
from tests.support.routing_cluster import (
    HISTORY_TOKENS,
    MODEL,
    RoutingCluster,
    decode_params,
    handle_for,
    prefill_and_decode,
    routing_settings,
    tokens,
)


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    # p0 and d0 in etcd; the replica under test is added below, the cluster has none of its own.
    async with prefill_and_decode(etcd, prefix, replicas=0) as c:
        yield c


@pytest.fixture
async def colocated(cluster: RoutingCluster) -> AsyncIterator[tuple[ServiceProcess, RoutingClient]]:
    routing = ColocatedRouting()
    process = ServiceProcess(
        routing_settings(cluster.etcd.endpoint, cluster.prefix), [routing.install], Telemetry.disabled()
    )
    await process.start()
    cluster.replicas.append(process)  # the cluster waits on its view and stops it
    await cluster.wait_nodes()
    client = routing.client(timeout_s=5.0)
    try:
        yield process, client
    finally:
        await client.close()


def conv() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


async def test_a_turn_routes_in_process_and_the_replica_still_serves_the_wire(
    cluster: RoutingCluster, colocated: tuple[ServiceProcess, RoutingClient]
) -> None:
    _, client = colocated
    assert client.targets == (IN_PROCESS_TARGET,)
    c = conv()
    first = await client.route(c, MODEL, prompt_token_ids=tokens(300), tenant="acme")
    assert first.decision == "recompute_no_handle"
    assert first.prefill.node_id == "p0" and first.decode.node_id == "d0"
    assert first.prefill_params[KEY_TENANT] == "acme"
    # The call ran as the gateway's own principal, in a task of its own: none is left behind.
    assert _PRINCIPAL.get() is None
    # The same replica answers off the wire, to a tenant's credentials.
    async with cluster.client("acme", 0) as wire:
        over_grpc = await wire.route(conv(), MODEL, prompt_token_ids=tokens(300))
    assert over_grpc.decision == "recompute_no_handle" and over_grpc.prefill.node_id == "p0"


async def test_a_reported_handle_is_pulled_once(
    cluster: RoutingCluster, colocated: tuple[ServiceProcess, RoutingClient]
) -> None:
    _, client = colocated
    c = conv()
    history = tokens(HISTORY_TOKENS)
    first = await client.route(c, MODEL, prompt_token_ids=history[:1000], tenant="acme")
    params = decode_params(cluster.nodes["d0"], history)
    # D's engine publishes its handle; the gateway's report of the turn goes in-process.
    await cluster.publish(cluster.handle_from_params("acme", c, params))
    await cluster.wait_handle("acme", c, params["kvplane_handle_id"])
    handle_id = await client.report_turn(
        first, c, success=True, decode_kv_transfer_params=params, tenant="acme", prompt_tokens=1000
    )
    assert handle_id == params["kvplane_handle_id"]
    prompt = [*history, 7, 8, 9]
    results = await asyncio.gather(
        *(client.route(c, MODEL, prompt_token_ids=prompt, tenant="acme") for _ in range(2))
    )
    decisions = [r.decision for r in results]
    assert decisions.count("pull") == 1, decisions
    loser = next(d for d in decisions if d != "pull")
    assert loser in ("recompute_contended", "recompute_no_handle"), decisions
    assert await cluster.store.get_handle_record("acme", c) is None


async def test_refusals_arrive_as_the_status_codes_of_the_wire(
    cluster: RoutingCluster, colocated: tuple[ServiceProcess, RoutingClient]
) -> None:
    _, client = colocated
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await client.route("", MODEL, prompt_token_ids=tokens(10), tenant="acme")
    assert invalid.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "conversation" in (invalid.value.details() or "")
    async with cluster.client("acme", 0) as wire:
        with pytest.raises(grpc.aio.AioRpcError) as off_the_wire:
            await wire.route("", MODEL, prompt_token_ids=tokens(10))
    assert off_the_wire.value.code() is invalid.value.code()
    assert off_the_wire.value.details() == invalid.value.details()


async def test_ending_a_conversation_in_process_releases_its_handle(
    cluster: RoutingCluster, colocated: tuple[ServiceProcess, RoutingClient]
) -> None:
    _, client = colocated
    c = conv()
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, tokens(HISTORY_TOKENS)))
    await cluster.wait_handle("acme", c, handle.handle_id)
    assert await client.end_conversation(c, tenant="acme") is True
    assert await cluster.store.get_handle_record("acme", c) is None


def test_a_client_over_stubs_refuses_hedging() -> None:
    with pytest.raises(ValueError, match="no hedging"):
        RoutingClient(["a"], stubs=[object()], hedge_after_s=0.2)
    with pytest.raises(ValueError, match="one per target"):
        RoutingClient(["a", "b"], stubs=[object()])
