"""ReportTurn of a turn that failed after its P leg: routing queues a release command for P's held
request, for whom it may, and the command reaches the prefill node's queue in etcd."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from kvplane.services.client import RouteResult
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.routing_cluster import MODEL, RoutingCluster, prefill_and_decode, tokens


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix, replicas=1) as c:
        yield c


def p_returned(cluster: RoutingCluster, request_id: str) -> dict[str, Any]:
    """What P answers after its leg: its own handle for D."""
    p = cluster.nodes["p0"]
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": p.engine_id,
        "remote_request_id": request_id,
        "remote_block_ids": [[1, 2, 3]],
        "remote_host": p.side_channel_host,
        "remote_port": p.side_channel_port,
        "remote_num_tokens": 48,
    }


async def queued(cluster: RoutingCluster) -> list[str]:
    """Request ids of the release commands waiting for p0."""
    return [p.handle.vllm.remote_request_id for p, _ in await cluster.store.pending_releases("p0")]


async def failed_report(
    client: Any, route: RouteResult | None, conversation: str, params: dict[str, Any]
) -> None:
    await client.report_turn(
        route, conversation, success=False, error="decode refused", prefill_kv_transfer_params=params
    )


async def test_a_tenants_failed_turn_queues_the_release_of_ps_held_request(cluster: RoutingCluster) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    async with cluster.client("acme") as client:
        route = await client.route(conversation, MODEL, prompt_token_ids=tokens(64))
        assert route.prefill.node_id == "p0"
        await failed_report(client, route, conversation, p_returned(cluster, "cmpl-p-held"))
    assert await queued(cluster) == ["cmpl-p-held"]
    (pending, _), *_ = await cluster.store.pending_releases("p0")
    assert pending.handle.holder_incarnation == cluster.nodes["p0"].incarnation


async def test_a_tenant_cannot_release_a_request_of_a_route_it_did_not_make(cluster: RoutingCluster) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    async with cluster.client("acme") as acme:
        route = await acme.route(conversation, MODEL, prompt_token_ids=tokens(64))
    async with cluster.client("globex") as globex:
        # Without a route, and with acme's route (another tenant's): nothing is queued.
        await failed_report(globex, None, conversation, p_returned(cluster, "cmpl-someone-elses"))
        await failed_report(globex, route, conversation, p_returned(cluster, "cmpl-someone-elses"))
    assert await queued(cluster) == []


async def test_the_gateway_may_release_for_any_of_its_turns_but_only_on_the_named_engine(
    cluster: RoutingCluster,
) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    async with cluster.client("acme") as acme:
        route = await acme.route(conversation, MODEL, prompt_token_ids=tokens(64))
    async with cluster.gateway() as gateway:
        wrong_engine = dict(p_returned(cluster, "cmpl-x"), remote_engine_id="engine-of-another-life")
        await gateway.report_turn(
            route, conversation, success=False, tenant="acme", prefill_kv_transfer_params=wrong_engine
        )
        assert await queued(cluster) == []
        await gateway.report_turn(
            route,
            conversation,
            success=False,
            tenant="acme",
            prefill_kv_transfer_params=p_returned(cluster, "cmpl-gw"),
        )
    assert await queued(cluster) == ["cmpl-gw"]


async def test_malformed_prefill_params_are_an_invalid_argument(cluster: RoutingCluster) -> None:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    async with cluster.client("acme") as client:
        route = await client.route(conversation, MODEL, prompt_token_ids=tokens(64))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await failed_report(client, route, conversation, {"do_remote_prefill": True, "x": [1]})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await queued(cluster) == []
