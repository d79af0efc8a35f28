"""Installs the eviction coordinator into a kvplane process (`kvplane serve eviction`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from grpc_health.v1 import health_pb2

from kvplane.services.eviction.coordinator import EvictionCoordinator
from kvplane.services.eviction.service import SERVICE_NAME, EvictionService
from kvplane.services.process import Component, ProcessContext
from kvplane.v1 import eviction_pb2_grpc

# A health-check service name that is SERVING only on the elected leader. A
# readiness probe on it keeps standbys out of a Kubernetes Service, so node
# agents, whose gRPC channel sticks to one pod, reach the leader.
LEADER_HEALTH_NAME = "kvplane.v1.EvictionService/leader"


def install(ctx: ProcessContext) -> Sequence[Component]:
    coordinator = EvictionCoordinator(ctx.store, ctx.view, ctx.settings.eviction, ctx.telemetry)
    ctx.server.add(
        SERVICE_NAME, eviction_pb2_grpc.add_EvictionServiceServicer_to_server, EvictionService(coordinator)
    )
    pending: set[asyncio.Task[None]] = set()

    def report(leading: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if leading else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.create_task(ctx.server.health.set(LEADER_HEALTH_NAME, status))
        pending.add(task)
        task.add_done_callback(pending.discard)

    coordinator.on_leadership(report)
    return [coordinator]
