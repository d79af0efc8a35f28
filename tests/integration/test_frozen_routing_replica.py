"""A routing replica that takes calls and answers none, as a frozen process does (SIGSTOP, a
stalled host: its kernel still accepts connections and queues requests).

It costs a turn one hedge delay (another replica answers) or the Route budget (the gateway
falls back), once: later calls skip it without asking it, until it answers a health check.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2
from pydantic import SecretStr

from kvplane.services.client import RoutingClient, RoutingUnavailable
from kvplane.services.client.routing_client import ROUTING_SERVICE
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from kvplane.v1 import routing_pb2
from tests.conftest import tenant_headers
from tests.integration.test_gateway_front import KEY, ScriptedEngine
from tests.support.polling import eventually
from tests.support.routing_cluster import MODEL, RoutingCluster, homed_at, prefill_and_decode

# A conversation whose Routes go first to the frozen replica (index 0 of 2).
AT_FROZEN = homed_at(0, 2)


class FrozenRouting:
    """Accepts Route and health calls and answers none of them until thawed.

    `slow_s`: instead, a live replica that answers each Route after this long (etcd is slow,
    say), and health checks after `health_s` (at once by default; later on a busy machine).
    """

    def __init__(self, slow_s: float | None = None, health_s: float = 0.0) -> None:
        self.routes = 0
        self.health_checks = 0
        self._slow_s = slow_s
        self._health_s = health_s
        self._thawed = asyncio.Event()
        self._server = grpc.aio.server()
        self.target = ""

    async def start(self) -> None:
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    ROUTING_SERVICE,
                    {
                        "Route": grpc.unary_unary_rpc_method_handler(
                            self._route,
                            request_deserializer=routing_pb2.RouteRequest.FromString,
                            response_serializer=routing_pb2.RouteResponse.SerializeToString,
                        )
                    },
                ),
                grpc.method_handlers_generic_handler(
                    "grpc.health.v1.Health",
                    {
                        "Check": grpc.unary_unary_rpc_method_handler(
                            self._check,
                            request_deserializer=health_pb2.HealthCheckRequest.FromString,
                            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
                        )
                    },
                ),
            )
        )
        port = free_port()
        self._server.add_insecure_port(f"127.0.0.1:{port}")
        await self._server.start()
        self.target = f"127.0.0.1:{port}"

    def thaw(self) -> None:
        self._thawed.set()

    async def stop(self) -> None:
        self._thawed.set()
        await self._server.stop(0)

    async def _route(
        self, request: routing_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> routing_pb2.RouteResponse:
        self.routes += 1
        if self._slow_s is not None:
            await asyncio.sleep(self._slow_s)  # a slow answer, not a frozen one
            return routing_pb2.RouteResponse(route_id="slow")
        await self._thawed.wait()
        # Running again, but with no view of the cluster yet: the caller moves on.
        await context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        raise AssertionError("abort returns no answer")

    async def _check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.health_checks += 1
        if self._slow_s is None:
            await self._thawed.wait()
        elif self._health_s:
            await asyncio.sleep(self._health_s)  # a busy event loop, not a frozen one
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
async def frozen() -> AsyncIterator[FrozenRouting]:
    replica = FrozenRouting()
    await replica.start()
    try:
        yield replica
    finally:
        await replica.stop()


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix) as c:
        yield c


async def _true(value: bool) -> bool:
    return value


async def test_route_goes_to_the_next_replica_when_the_first_never_answers(
    cluster: RoutingCluster, frozen: FrozenRouting
) -> None:
    # A deadline far longer than the wait allowed below: only the hedge can answer in time.
    async with RoutingClient(
        [frozen.target, cluster.target(0)],
        metadata=tenant_headers("acme"),
        timeout_s=60.0,
        hedge_after_s=0.1,
    ) as client:
        first = await asyncio.wait_for(client.route(AT_FROZEN, MODEL, prompt_tokens=10, request_id="r1"), 20)
        assert first.replica == 1 and first.decision == "recompute_no_handle"
        assert frozen.routes == 1
        # The frozen replica also missed its health check.
        await eventually(
            lambda: _true(client.suspect_replicas == {frozen.target}), what="the frozen replica suspect"
        )
        # Later Routes skip it without asking it (nor waiting a hedge delay on it).
        for i in range(4):
            later = await client.route(AT_FROZEN, MODEL, prompt_tokens=10, request_id=f"r{i + 2}")
            assert later.replica == 1
        assert frozen.routes == 1
        assert frozen.health_checks >= 1


async def test_a_suspect_replica_is_asked_again_once_it_answers_a_health_check(
    cluster: RoutingCluster, frozen: FrozenRouting
) -> None:
    async with RoutingClient(
        [frozen.target, cluster.target(0)],
        metadata=tenant_headers("acme"),
        timeout_s=60.0,
        hedge_after_s=0.1,
        probe_interval_s=0.05,
    ) as client:
        await asyncio.wait_for(client.route(AT_FROZEN, MODEL, prompt_tokens=10), 20)
        await eventually(lambda: _true(bool(client.suspect_replicas)), what="the frozen replica suspect")
        frozen.thaw()
        await eventually(lambda: _true(not client.suspect_replicas), what="the thawed replica trusted")
        # The conversation's home is asked again; its refusal moves the call on to the other replica.
        for _ in range(4):
            assert (await client.route(AT_FROZEN, MODEL, prompt_tokens=10)).replica == 1
        assert frozen.routes > 1


async def test_a_slow_replica_that_answers_health_checks_keeps_its_call() -> None:
    slow = FrozenRouting(slow_s=0.6)
    await slow.start()
    try:
        async with RoutingClient([slow.target], timeout_s=30.0, hedge_after_s=0.1) as client:
            answer = await client.route("c", MODEL, prompt_tokens=10)
            assert answer.route_id == "slow"
            assert slow.health_checks == 1 and not client.suspect_replicas
    finally:
        await slow.stop()


async def test_a_busy_replica_whose_health_check_is_slow_is_not_taken_for_dead() -> None:
    # Its health check answers in 0.6 s, as a replica on a loaded machine may: slow, but alive.
    # The check judges liveness (its default deadline, 2 s), so the replica keeps its call and
    # later calls still go to it.
    busy = FrozenRouting(slow_s=0.8, health_s=0.6)
    await busy.start()
    try:
        async with RoutingClient([busy.target], timeout_s=30.0, hedge_after_s=0.1) as client:
            for _ in range(2):
                answer = await client.route("c", MODEL, prompt_tokens=10)
                assert answer.route_id == "slow"
            assert busy.health_checks == 2 and not client.suspect_replicas
    finally:
        await busy.stop()


async def test_with_every_replica_suspect_a_route_fails_at_once(frozen: FrozenRouting) -> None:
    async with RoutingClient(
        [frozen.target], timeout_s=60.0, hedge_after_s=0.1, probe_timeout_s=0.2
    ) as client:
        # Long before the deadline: the replica missed its health check.
        with pytest.raises(RoutingUnavailable, match="missed a health check"):
            await asyncio.wait_for(client.route("c", MODEL, prompt_tokens=10), 20)
        with pytest.raises(RoutingUnavailable, match="has not answered a health check since"):
            await client.route("c", MODEL, prompt_tokens=10)
        assert frozen.routes == 1


async def test_gateway_falls_back_within_its_route_budget_and_then_skips_the_frozen_replica(
    frozen: FrozenRouting,
) -> None:
    prefill, decode = ScriptedEngine("prefill"), ScriptedEngine("decode")
    await prefill.start()
    await decode.start()
    gateway = Gateway(
        GatewaySection(
            listen=f"127.0.0.1:{free_port()}",
            routing=[frozen.target],
            # The budget for a silent replica: 0.1 s of silence, then a 0.3 s health check. The
            # Route's own deadline is far longer, so the turn's wait shows which one ended it.
            routing_timeout_s=60.0,
            routing_hedge_after_s=0.1,
            routing_liveness_timeout_s=0.3,
            api_keys=[GatewayKey(token=SecretStr(KEY), tenant="acme")],
            fallback_prefill_url=prefill.url,
            fallback_decode_url=decode.url,
            prefill_timeout_s=5.0,
        ),
        Telemetry.disabled("kvplane-gateway"),
    )
    await gateway.start()
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}
    headers = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "frozen"}
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                post = session.post(gateway.url + "/v1/completions", json=body, headers=headers)
                async with await asyncio.wait_for(post, 20) as resp:
                    await resp.read()
                    assert resp.status == 200
                    assert resp.headers["x-kvplane-decision"] == "fallback"
            # Only the first turn asked the frozen replica; the others fell back at once.
            assert frozen.routes == 1
    finally:
        await gateway.stop()
        await prefill.stop()
        await decode.stop()
