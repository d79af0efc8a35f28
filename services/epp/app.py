"""The picker's gRPC server: Envoy's ExternalProcessor, and the health service Kubernetes and Envoy
probe (`liveness`, `readiness`, and the ext_proc service's own name)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import Counter

from kvplane.services.client import RoutingClient
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.epp.answers import PendingAnswers, answers_app
from kvplane.services.epp.exchange import Exchange
from kvplane.services.epp.picker_state import PickerState
from kvplane.services.epp.settings import EppSection
from kvplane.services.gateway import admission
from kvplane.services.gateway.app import routing_client, split_host_port
from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.tenant_share import TenantShares
from kvplane.services.gateway.turn import TurnRunner
from kvplane.services.gateway.turn_request import configured_api_keys
from kvplane.services.sidecar.settings import SidecarSection

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
HEALTH_NAMES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
_MESSAGE_KINDS = (
    "request_headers",
    "request_body",
    "request_trailers",
    "response_headers",
    "response_body",
    "response_trailers",
    "none",
)


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's ext_proc service: one Exchange per stream."""

    def __init__(self, state: PickerState, messages: Counter) -> None:
        self.state = state
        self.messages = messages

    async def Process(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        exchange = Exchange(self.state)
        counted = {kind: self.messages.labels(kind) for kind in _MESSAGE_KINDS}
        try:
            async for message in request_iterator:
                counted[message.WhichOneof("request") or "none"].inc()
                for response in await exchange.handle(message):
                    yield response
        finally:
            exchange.close()


class Picker:
    """The picker's server, routing client and engine session; start() and stop() bracket its life."""

    def __init__(
        self,
        epp: EppSection,
        gateway: GatewaySection,
        sidecar: SidecarSection,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.epp = epp
        self.gateway = gateway
        self.sidecar = sidecar
        self.telemetry = telemetry or Telemetry.create("kvplane-epp")
        self.metrics = GatewayMetrics.create(self.telemetry.registry)
        # What Envoy sends the picker: each message costs the picker a gRPC read and a write.
        self.messages = Counter(
            "kvplane_epp_messages",
            "ext_proc messages received from Envoy, by kind",
            ["kind"],
            registry=self.telemetry.registry,
        )
        self._server: grpc.aio.Server | None = None
        self._routing: RoutingClient | None = None
        self._session: aiohttp.ClientSession | None = None
        self.health = HealthServicer()
        self.state: PickerState | None = None
        self.port = 0
        self._answers_runner: web.AppRunner | None = None
        self.answers_port = 0

    async def start(self) -> None:
        g = self.gateway
        if not self.sidecar.route_key.get_secret_value():
            raise ValueError("sidecar.route_key is required: the sidecars verify the picker's routes with it")
        self._routing = routing_client(g, self.telemetry)
        # The tokenize calls' pool (the engine legs are the sidecars').
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        turns = TurnRunner(g, self._routing, self._session, self.metrics, self.telemetry.tracer)
        self.state = PickerState(
            epp=self.epp,
            gateway=g,
            turns=turns,
            keys=configured_api_keys(g),
            salts=CacheSalts.create(g.cache_salt, g.salt_key(), g.tenant_groups),
            shares=TenantShares(g.max_inflight_tokens_per_tenant),
            body_reads=TenantShares(
                admission.read_limits(g).max_tenant_body_bytes, unit="request-body bytes"
            ),
            route_key=self.sidecar.route_key.get_secret_value().encode(),
            route_ttl_s=self.sidecar.route_ttl_s,
            tracer=self.telemetry.tracer,
        )
        if self.epp.answers_listen:
            pending = PendingAnswers(self._answer_wait_s())
            url = await self._serve_answers(pending)
            self.state = dataclasses.replace(self.state, answers=pending, answers_url=url)
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.state, self.messages), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(self.epp.listen)
        await self._server.start()
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("endpoint picker serving", extra={"listen": self.epp.listen, "port": self.port})

    def _answer_wait_s(self) -> float:
        """How long a turn waits for its sidecar's report: its legs' deadlines and the report's."""
        g = self.gateway
        return g.prefill_timeout_s + g.decode_timeout_s + g.report_timeout_s

    async def _serve_answers(self, pending: PendingAnswers) -> str:
        """Starts the answer endpoint; returns its URL as the sidecars reach it."""
        host, port = split_host_port(self.epp.answers_listen)
        if not self.epp.answers_url and host in ("", "0.0.0.0", "::"):
            raise ValueError("epp.answers_url is required when epp.answers_listen binds every address")
        key = self.sidecar.route_key.get_secret_value().encode()
        self._answers_runner = web.AppRunner(answers_app(pending, key), access_log=None)
        await self._answers_runner.setup()
        site = web.TCPSite(self._answers_runner, host, port)
        await site.start()
        server = site._server  # aiohttp has no public getter for the bound port
        bound = server.sockets[0].getsockname()[1] if isinstance(server, asyncio.Server) else port
        self.answers_port = int(bound)
        if self.epp.answers_url:
            return self.epp.answers_url
        return f"http://{f'[{host}]' if ':' in host else host}:{self.answers_port}"

    @property
    def address(self) -> str:
        host = self.epp.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        for name in HEALTH_NAMES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._answers_runner is not None:
            await self._answers_runner.cleanup()
            self._answers_runner = None
        if self.state is not None and self.state.answers is not None:
            self.state.answers.close()
        if self.state is not None:
            await self.state.turns.drain_reports(self.gateway.report_timeout_s)
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._routing is not None:
            await self._routing.close()
            self._routing = None
