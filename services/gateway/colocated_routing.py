"""Routing in the gateway's own process (`gateway.routing_in_process`).

A gateway that asks a routing replica over gRPC pays, on every turn, for two
protobuf encodings and decodings, a loopback round trip, and gRPC's threads
waking on both sides; on a machine whose cores are busy (an engine's host) the
wake-ups cost more than the routing does. A gateway with routing in its own
process calls the routing servicer directly: the same servicer, the same
checks of the request, the same view of the cluster, without the hop.

The process is still a routing replica: it serves RoutingService on
`grpc.listen`, so that engines stream their loads and KV events to it and other
callers may route through it. What the gateway sends in-process is authorised
as the process's own operator principal; calls off the wire are
authenticated as in every kvplane server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from kvplane.services.client import RoutingClient
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.runtime.server import acting_as
from kvplane.services.process import Component, ProcessContext
from kvplane.services.routing import app as routing_app
from kvplane.services.routing.service import RoutingService

# The target name the gateway's logs and the client's errors give the in-process replica.
IN_PROCESS_TARGET = "in-process"
# Who the gateway's in-process calls act as: the gateway is an operator of its own replica.
GATEWAY_PRINCIPAL = Principal(PrincipalKind.OPERATOR, "gateway (in process)")

Request = TypeVar("Request")
Response = TypeVar("Response")


class _Aborted(grpc.aio.AbortError):
    """A servicer's abort, carrying its status to the stub."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _LocalContext:
    """What the routing servicer reads of a call's context: its deadline, and abort."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[Any] = ()
    ) -> NoReturn:
        raise _Aborted(code, details)


class InProcessRoutingStub:
    """RoutingService's client stub over a servicer in the same process.

    Each method takes what the generated stub's does and returns an awaitable of the response;
    a status the servicer aborts with is raised as `grpc.aio.AioRpcError`, as off the wire, so
    that `RoutingClient` and its callers handle both alike. The request is handed over as is:
    the caller must not change it afterwards (RoutingClient never does).
    """

    def __init__(self, servicer: RoutingService, principal: Principal = GATEWAY_PRINCIPAL) -> None:
        self.servicer = servicer
        self.principal = principal

    async def _call(
        self,
        method: Callable[[Request, Any], Awaitable[Response]],
        request: Request,
        timeout_s: float | None,
    ) -> Response:
        try:
            with acting_as(self.principal):
                return await method(request, _LocalContext(timeout_s))
        except _Aborted as exc:
            raise grpc.aio.AioRpcError(
                exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=exc.details
            ) from None

    def Route(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Awaitable[Any]:
        return self._call(self.servicer.Route, request, timeout)

    def ReportTurn(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Awaitable[Any]:
        return self._call(self.servicer.ReportTurn, request, timeout)

    def ReportTurns(self, request: Any, timeout: float | None = None, metadata: Any = None) -> Awaitable[Any]:
        return self._call(self.servicer.ReportTurns, request, timeout)

    def EndConversation(
        self, request: Any, timeout: float | None = None, metadata: Any = None
    ) -> Awaitable[Any]:
        return self._call(self.servicer.EndConversation, request, timeout)


class ColocatedRouting:
    """Installs a routing replica into the gateway's process and hands the gateway its client."""

    def __init__(self) -> None:
        self.servicer: RoutingService | None = None

    def install(self, ctx: ProcessContext) -> Sequence[Component]:
        self.servicer, components = routing_app.install_servicer(ctx)
        return components

    def client(self, *, timeout_s: float, report_hold_s: float = 0.25) -> RoutingClient:
        """The gateway's routing client, calling the installed servicer in-process."""
        if self.servicer is None:
            raise RuntimeError("the routing replica is not installed yet")
        return RoutingClient(
            [IN_PROCESS_TARGET],
            stubs=[InProcessRoutingStub(self.servicer)],
            timeout_s=timeout_s,
            attempts=1,
            report_hold_s=report_hold_s,
        )
