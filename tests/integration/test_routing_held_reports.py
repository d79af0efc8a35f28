"""Held turn reports: they ride on the next Route to their replica, applied before it is decided,
or go in one ReportTurns; a replica that predates them gets each in a ReportTurn of its own."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvplane.services.client import RouteResult
from kvplane.services.client.routing_client import report_request
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.v1 import routing_pb2, routing_pb2_grpc
from tests.support.routing_cluster import MODEL, RoutingCluster, homed_at, node

REPORTS = "kvplane_turn_reports_total"


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    c = RoutingCluster(etcd, prefix, store)
    try:
        await c.register(node("p0", NodeRole.PREFILL))
        await c.register(node("d0", NodeRole.DECODE))
        await c.add_replica()
        await c.wait_nodes()
        yield c
    finally:
        await c.stop()
        await store.close()


def _applied(cluster: RoutingCluster, index: int = 0) -> float:
    registry = cluster.replicas[index].telemetry.registry
    return registry.get_sample_value(REPORTS, {"outcome": "success", "published": "false"}) or 0.0


def _report(route: RouteResult, conversation: str, ttft_ms: float = 500.0) -> routing_pb2.ReportTurnRequest:
    return report_request(
        route, conversation, success=True, ttft_ms=ttft_ms, prompt_tokens=100, prefill_ms=400.0, tenant="acme"
    )


async def test_a_held_report_rides_on_the_next_route_to_its_replica(cluster: RoutingCluster) -> None:
    # Held far longer than the test: only the Route can carry it.
    async with cluster.gateway(report_hold_s=3600) as client:
        first = await client.route("c1", MODEL, prompt_tokens=100, tenant="acme")
        client.hold_report(first, _report(first, "c1"))
        assert _applied(cluster) == 0, "held, not sent"
        second = await client.route("c1", MODEL, prompt_tokens=200, tenant="acme")
        assert second.response.reports_taken == 1
        assert _applied(cluster) == 1
        assert await client.send_held_reports() == 0, "nothing is left held"


async def test_held_reports_no_route_takes_go_in_one_report_turns_within_the_bound(
    cluster: RoutingCluster,
) -> None:
    async with cluster.gateway(report_hold_s=0.05) as client:
        routes = [await client.route(f"c{i}", MODEL, prompt_tokens=100, tenant="acme") for i in range(3)]
        for i, route in enumerate(routes):
            client.hold_report(route, _report(route, f"c{i}"))
        deadline = time.monotonic() + 10
        while _applied(cluster) < 3:
            assert time.monotonic() < deadline, "the held reports were never sent"
            await _tick()


async def test_a_bad_carried_report_never_fails_the_route(cluster: RoutingCluster) -> None:
    async with cluster.gateway(report_hold_s=3600) as client:
        first = await client.route("c1", MODEL, prompt_tokens=100, tenant="acme")
        bad = _report(first, "c1")
        bad.conversation = ""  # not a conversation id
        client.hold_report(first, bad)
        second = await client.route("c1", MODEL, prompt_tokens=200, tenant="acme")
        assert second.decision and second.response.reports_taken == 1, "taken, and skipped"
        assert _applied(cluster) == 0
        # Not taken for a replica that predates held reports: the next report still rides a Route.
        client.hold_report(second, _report(second, "c1"))
        third = await client.route("c1", MODEL, prompt_tokens=300, tenant="acme")
        assert third.response.reports_taken == 1 and _applied(cluster) == 1


class _OldRouting(routing_pb2_grpc.RoutingServiceServicer):
    """A replica that predates held reports: Route ignores `reports`, no ReportTurns."""

    def __init__(self) -> None:
        self.reported: list[str] = []

    async def Route(self, request: routing_pb2.RouteRequest, context: object) -> routing_pb2.RouteResponse:
        return routing_pb2.RouteResponse(route_id=f"r-{request.conversation}-{request.prompt_tokens}")

    async def ReportTurn(
        self, request: routing_pb2.ReportTurnRequest, context: object
    ) -> routing_pb2.ReportTurnResponse:
        self.reported.append(request.route_id)
        return routing_pb2.ReportTurnResponse()


async def test_a_replica_that_predates_held_reports_gets_each_in_a_report_turn() -> None:
    from kvplane.services.client import RoutingClient

    server = grpc.aio.server()
    old = _OldRouting()
    routing_pb2_grpc.add_RoutingServiceServicer_to_server(old, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with RoutingClient([f"127.0.0.1:{port}"], report_hold_s=0.05, timeout_s=5.0) as client:
            conversation = homed_at(0, 1)
            first = await client.route(conversation, MODEL, prompt_tokens=10)
            client.hold_report(first, _report(first, conversation))
            # Carried by this Route, which applies none: sent again, alone.
            await client.route(conversation, MODEL, prompt_tokens=20)
            second = await client.route(conversation, MODEL, prompt_tokens=30)
            client.hold_report(second, _report(second, conversation))  # ReportTurns is UNIMPLEMENTED
            deadline = time.monotonic() + 10
            while len(old.reported) < 2:
                assert time.monotonic() < deadline, f"reports lost: {old.reported}"
                await _tick()
            assert old.reported == [first.route_id, second.route_id]
    finally:
        await server.stop(None)


async def _tick() -> None:
    import asyncio

    await asyncio.sleep(0.02)  # polling with a deadline
