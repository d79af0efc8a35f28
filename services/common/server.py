"""gRPC server bootstrap shared by every service.

Every server gets the standard health service, server reflection, an
OpenTelemetry server interceptor and the caller's Principal on each call
(`caller(context)`), with errors mapped in `grpc_errors`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from prometheus_client import start_http_server

from kvplane.services.common.auth import Authenticator, Principal, metadata_dict
from kvplane.services.common.telemetry import Telemetry

log = logging.getLogger(__name__)

# The context type of every servicer method.
Context = grpc.aio.ServicerContext[Any, Any]


class GrpcServer:
    """A grpc.aio server with health, reflection, tracing and authentication."""

    def __init__(self, listen: str, telemetry: Telemetry, authenticator: Authenticator) -> None:
        self.listen = listen
        self.telemetry = telemetry
        self.authenticator = authenticator
        self.server = grpc.aio.server(
            interceptors=[aio_server_interceptor(tracer_provider=telemetry.tracer_provider)],  # type: ignore[no-untyped-call]
            options=[("grpc.so_reuseport", 0)],
        )
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self.port = 0

    def add(self, full_name: str, register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> None:
        """Registers `servicer` (with `authenticator` attached) under `full_name`."""
        servicer.authenticator = self.authenticator
        register(servicer, self.server)
        self._services.append(full_name)

    async def start(self) -> int:
        reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(self.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.listen}")
        await self.server.start()
        for name in self._services:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "grpc listening", extra={"listen": self.listen, "port": self.port, "services": self._services}
        )
        return self.port

    async def stop(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def caller(servicer: Any, context: Context) -> Principal:
    """The authenticated principal of the current call (raises Unauthenticated)."""
    authenticator: Authenticator = servicer.authenticator
    pairs = [(str(k), v) for k, v in context.invocation_metadata() or ()]
    return authenticator.authenticate(metadata_dict(pairs), context.peer() or "")


class MetricsServer:
    """Prometheus text exposition on its own port, in a daemon thread."""

    def __init__(self, telemetry: Telemetry, host: str, port: int) -> None:
        self.telemetry = telemetry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        self._server, self._thread = start_http_server(self.port, self.host, registry=self.telemetry.registry)
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
