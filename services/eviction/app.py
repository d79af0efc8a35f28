"""Installs the eviction coordinator into a kvplane process (`kvplane serve eviction`)."""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.services.common.process import Component, ProcessContext
from kvplane.services.eviction.coordinator import EvictionCoordinator
from kvplane.services.eviction.service import SERVICE_NAME, EvictionService
from kvplane.v1 import eviction_pb2_grpc


def install(ctx: ProcessContext) -> Sequence[Component]:
    coordinator = EvictionCoordinator(ctx.store, ctx.view, ctx.settings.eviction, ctx.telemetry)
    ctx.server.add(
        SERVICE_NAME, eviction_pb2_grpc.add_EvictionServiceServicer_to_server, EvictionService(coordinator)
    )
    return [coordinator]
