"""gRPC server bootstrap shared by every service.

Every server gets the standard health service, an OpenTelemetry server
interceptor, TLS when configured (certificates re-read when they change),
and server reflection only when enabled.

Every method of every kvplane service added here is guarded before its code
runs, so a method added later cannot be left open:
- the caller is authenticated first (UNAUTHENTICATED otherwise), and its
  Principal is what `caller(context)` returns;
- a request that does not parse (corrupt wire bytes, invalid UTF-8 in a
  string field) is answered INVALID_ARGUMENT, never INTERNAL or UNKNOWN.
The standard health service stays open: probes carry no credentials and it
tells only whether the process serves.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from prometheus_client import start_http_server

from kvplane.services.common.model.errors import InvalidArgument, KvplaneError, Unauthenticated
from kvplane.services.common.runtime.auth import Authenticator, CallCredentials, Principal, metadata_dict
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.runtime.tls import ServerTlsFiles, certificate_ids

log = logging.getLogger(__name__)
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The health service name that stays SERVING while the process runs (liveness probes), whatever
# its dependencies do; "" and each service's name follow readiness (`set_serving`).
LIVENESS = "liveness"


class BindFailed(OSError):
    """A server could not listen where it was told to: one line naming the address and the role."""

    def __init__(self, address: str, what: str, reason: str | None = None) -> None:
        self.address = address
        self.what = what
        why = reason or "the address is in use or not available on this host"
        super().__init__(f"cannot listen on {address} for {what}: {why}")

    def __str__(self) -> str:
        return str(self.args[0])


# The context type of every servicer method.
Context = grpc.aio.ServicerContext[Any, Any]


class GrpcServer:
    """A grpc.aio server with health, tracing, authentication, and optionally TLS and reflection."""

    def __init__(
        self,
        listen: str,
        telemetry: Telemetry,
        authenticator: Authenticator,
        *,
        tls: ServerTlsFiles | None = None,
        reflection: bool = False,
    ) -> None:
        self.listen = listen
        self.telemetry = telemetry
        self.authenticator = authenticator
        self.tls = tls
        self.reflection = reflection
        # A process that exports no spans joins no traces: the tracing interceptor would only cost.
        interceptors = (
            [aio_server_interceptor(tracer_provider=telemetry.tracer_provider)]  # type: ignore[no-untyped-call]
            if telemetry.exports
            else []
        )
        self.server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._services: list[str] = [_HEALTH]
        self.port = 0

    def add(self, full_name: str, register: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> None:
        """Registers `servicer` under `full_name`, every method guarded (see the module docstring)."""
        servicer.authenticator = self.authenticator
        captured = _CapturedHandlers()
        register(servicer, captured)  # type: ignore[arg-type]
        for service, handlers in captured.services.items():
            guarded = {name: _guard(h, self.authenticator) for name, h in handlers.items()}
            self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, guarded),))
            self.server.add_registered_method_handlers(service, guarded)
        self._services.append(full_name)

    async def set_serving(self, serving: bool) -> None:
        """Every service's health (and the server's as a whole): SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in [*(s for s in self._services if s != _HEALTH), ""]:
            await self.health.set(name, status)

    async def start(self) -> int:
        if self.reflection:
            reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.server)
        names = [s.rsplit(".", 1)[-1] for s in self._services if s != _HEALTH]
        what = f"gRPC of {', '.join(names) or 'kvplane'}"
        try:
            if self.tls is not None:
                self.port = self.server.add_secure_port(self.listen, self.tls.server_credentials())
            else:
                self.port = self.server.add_insecure_port(self.listen)
        except RuntimeError:
            raise BindFailed(self.listen, what) from None
        if self.port == 0:
            raise BindFailed(self.listen, what)
        await self.server.start()
        for name in [*self._services, "", LIVENESS]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "grpc listening",
            extra={
                "listen": self.listen,
                "port": self.port,
                "services": self._services,
                "tls": "mutual" if self.tls and self.tls.mutual else ("server" if self.tls else "off"),
                "reflection": self.reflection,
            },
        )
        return self.port

    async def stop(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


# The authenticated principal of the call being served (set by the guard, per call task).
_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "kvplane_principal", default=None
)


@contextlib.contextmanager
def acting_as(principal: Principal) -> Iterator[None]:
    """Within the block, `caller(context)` returns `principal`: what the guard does for a call
    off the wire, for a caller in the same process."""
    token = _PRINCIPAL.set(principal)
    try:
        yield
    finally:
        _PRINCIPAL.reset(token)


def call_credentials(context: Context) -> CallCredentials:
    pairs = [(str(k), v) for k, v in context.invocation_metadata() or ()]
    return CallCredentials(
        metadata_dict(pairs), context.peer() or "", certificate_ids(context.auth_context() or {})
    )


def caller(servicer: Any, context: Context) -> Principal:
    """The authenticated principal of the current call (raises Unauthenticated)."""
    principal = _PRINCIPAL.get()
    if principal is not None:
        return principal
    authenticator: Authenticator = servicer.authenticator
    return authenticator.authenticate(call_credentials(context))


class _CapturedHandlers:
    """Stands in for the server while generated code registers a servicer's handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers also arrive, by name, below

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.services[service] = dict(handlers)


class _Unparsable:
    """A request whose bytes did not parse; the guard answers it INVALID_ARGUMENT."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError, RuntimeError):
            # Python's protobuf raises DecodeError for corrupt bytes and for
            # invalid UTF-8 in a string field.
            return _Unparsable("the request is not a valid protobuf message of this method's type")

    return deserialize


async def _admit(authenticator: Authenticator, context: Context) -> None:
    """Authenticates the call and records its principal, or ends the call UNAUTHENTICATED."""
    try:
        _PRINCIPAL.set(authenticator.authenticate(call_credentials(context)))
    except KvplaneError as exc:
        code = (
            grpc.StatusCode.UNAUTHENTICATED
            if isinstance(exc, Unauthenticated)
            else grpc.StatusCode.INVALID_ARGUMENT
        )
        await context.abort(code, str(exc))


async def _parsed(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Unparsable):
            raise InvalidArgument("request", request.reason)
        yield request


def _guard(
    handler: grpc.RpcMethodHandler[Any, Any], authenticator: Authenticator
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` behind authentication and lenient parsing."""
    h: Any = handler
    deserializer = _lenient(h.request_deserializer)
    if h.unary_unary is not None:
        inner_uu = h.unary_unary

        async def unary_unary(request: Any, context: Context) -> Any:
            await _admit(authenticator, context)
            if isinstance(request, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.reason}")
            return await inner_uu(request, context)

        return h._replace(request_deserializer=deserializer, unary_unary=unary_unary)  # type: ignore[no-any-return]
    if h.unary_stream is not None:
        inner_us = h.unary_stream

        async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
            await _admit(authenticator, context)
            if isinstance(request, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.reason}")
            async for item in inner_us(request, context):
                yield item

        return h._replace(request_deserializer=deserializer, unary_stream=unary_stream)  # type: ignore[no-any-return]
    if h.stream_stream is not None:
        inner_ss = h.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            await _admit(authenticator, context)
            async for item in inner_ss(_parsed(requests), context):
                yield item

        return h._replace(request_deserializer=deserializer, stream_stream=stream_stream)  # type: ignore[no-any-return]
    inner_su = h.stream_unary

    async def stream_unary(requests: AsyncIterator[Any], context: Context) -> Any:
        await _admit(authenticator, context)
        return await inner_su(_parsed(requests), context)

    return h._replace(request_deserializer=deserializer, stream_unary=stream_unary)  # type: ignore[no-any-return]


class MetricsServer:
    """Prometheus text exposition on its own port, in a daemon thread."""

    def __init__(self, telemetry: Telemetry, host: str, port: int) -> None:
        self.telemetry = telemetry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        try:
            self._server, self._thread = start_http_server(
                self.port, self.host, registry=self.telemetry.registry
            )
        except OSError as exc:
            raise BindFailed(f"{self.host}:{self.port}", "Prometheus metrics", exc.strerror) from None
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
