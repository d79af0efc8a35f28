"""Installs the routing service into a kvplane process (`kvplane serve routing`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.process import Component, ProcessContext
from kvplane.services.routing.service import SERVICE_NAME, RoutingService
from kvplane.v1 import routing_pb2_grpc

log = logging.getLogger(__name__)

# How long start-up waits for the view's first snapshot before serving anyway.
_VIEW_READY_WAIT_S = 5.0


class _ViewReady:
    """Holds start-up until the cluster view has loaded, so the first Routes see nodes.

    If etcd is down the service starts regardless: Route answers UNAVAILABLE
    until nodes are known, and callers retry another replica.
    """

    def __init__(self, view: ClusterView) -> None:
        self.view = view

    async def start(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_VIEW_READY_WAIT_S):
                await self.view.ready.wait()
        if not self.view.ready.is_set():
            log.warning("routing starts before the cluster view loaded")

    async def stop(self) -> None:
        return None


def install_servicer(ctx: ProcessContext) -> tuple[RoutingService, Sequence[Component]]:
    """Registers a routing servicer on the process's server; the servicer (for callers in the
    same process) and the components to start."""
    servicer = RoutingService(ctx.store, ctx.view, ctx.settings.routing, ctx.telemetry)
    ctx.server.add(SERVICE_NAME, routing_pb2_grpc.add_RoutingServiceServicer_to_server, servicer)
    return servicer, [_ViewReady(ctx.view)]


def install(ctx: ProcessContext) -> Sequence[Component]:
    return install_servicer(ctx)[1]
