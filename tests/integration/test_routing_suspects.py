"""Nodes a turn cannot use: one that just failed a leg (the turn's retry never goes back to it, and a
gateway's report keeps every routing replica off it until it proves alive), and none at all for a
model no node serves (NOT_FOUND, that request's own error)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.routing_cluster import MODEL, RoutingCluster, node, tokens


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    c = RoutingCluster(etcd, prefix, store)
    try:
        await c.register(node("p0", NodeRole.PREFILL))
        await c.register(node("d0", NodeRole.DECODE))
        await c.register(node("d1", NodeRole.DECODE))
        await c.add_replica()
        await c.add_replica()
        await c.wait_nodes()
        # d1 looks busier: left alone, routing prefers d0.
        await c.report_load("d0", free_kv_blocks=1000, total_kv_blocks=1000)
        await c.report_load("d1", free_kv_blocks=100, total_kv_blocks=1000, running_requests=8)
        await c.wait_views(lambda v: {"d0", "d1"} <= set(v.loads), "both decode loads")
        yield c
    finally:
        await c.stop()
        await store.close()


async def _decodes(cluster: RoutingCluster, replica: int, turns: int = 6, **kwargs: object) -> set[str]:
    chosen = set()
    async with cluster.client("acme", replica) as client:
        for _ in range(turns):
            route = await client.route(
                f"c-{uuid.uuid4().hex[:8]}", MODEL, prompt_token_ids=tokens(64), **kwargs
            )
            chosen.add(route.decode.node_id)
    return chosen


async def test_routing_prefers_the_idle_decode_node_here(cluster: RoutingCluster) -> None:
    assert await _decodes(cluster, 0) == {"d0"}


async def test_a_retry_never_goes_back_to_the_node_that_just_failed(cluster: RoutingCluster) -> None:
    assert await _decodes(cluster, 0, failed_node_ids=["d0"]) == {"d1"}
    # A tenant's retry steers only its own route: no replica marks the node.
    assert await _decodes(cluster, 1) == {"d0"}
    assert not cluster.replicas[0].ctx.view.suspects


async def test_a_gateways_failure_report_keeps_every_replica_off_the_node(cluster: RoutingCluster) -> None:
    async with cluster.gateway(0) as gateway:
        route = await gateway.route(
            "c-failed", MODEL, prompt_token_ids=tokens(64), tenant="acme", failed_node_ids=["d0"]
        )
    assert route.decode.node_id == "d1"
    await cluster.wait_views(lambda v: "d0" in v.suspects, "d0 suspect in every view")

    assert await _decodes(cluster, 0) == {"d1"}
    assert await _decodes(cluster, 1) == {"d1"}


async def test_a_suspect_node_is_routed_again_once_a_load_report_shows_it_alive(
    cluster: RoutingCluster,
) -> None:
    async with cluster.gateway(0) as gateway:
        await gateway.route(
            "c-failed", MODEL, prompt_token_ids=tokens(64), tenant="acme", failed_node_ids=["d0"]
        )
    await cluster.wait_views(lambda v: "d0" in v.suspects, "d0 suspect in every view")
    assert await _decodes(cluster, 1) == {"d1"}

    await cluster.report_load("d0", free_kv_blocks=1000, total_kv_blocks=1000)
    await cluster.wait_views(
        lambda v: v.loads["d0"].reported_unix_ms > v.suspects["d0"].marked_unix_ms, "d0's fresh load report"
    )
    assert await _decodes(cluster, 1) == {"d0"}


async def test_a_suspect_is_still_chosen_when_no_other_node_of_its_role_is_left(
    cluster: RoutingCluster,
) -> None:
    await cluster.kill_node("d1")
    await cluster.wait_views(lambda v: "d1" not in v.nodes, "d1 gone")
    assert await _decodes(cluster, 0, turns=2, failed_node_ids=["d0"]) == {"d0"}


async def test_a_model_no_node_serves_is_not_found_for_that_request_alone(cluster: RoutingCluster) -> None:
    async with cluster.client("acme", 0) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await client.route("c-unknown-model", "no-such-model", prompt_token_ids=tokens(64))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        route = await client.route("c-known-model", MODEL, prompt_token_ids=tokens(64))
    assert route.decode.node_id == "d0"
