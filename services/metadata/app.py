"""Installs the metadata service into a kvplane process."""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.services.metadata.claim_reaper import ClaimReaper
from kvplane.services.metadata.service import SERVICE_NAME, MetadataService
from kvplane.services.process import Component, ProcessContext
from kvplane.v1 import metadata_pb2_grpc


def install(ctx: ProcessContext) -> Sequence[Component]:
    servicer = MetadataService(ctx.store, ctx.settings.metadata, ctx.telemetry, ctx.view)
    ctx.server.add(SERVICE_NAME, metadata_pb2_grpc.add_MetadataServiceServicer_to_server, servicer)
    m = ctx.settings.metadata
    return [
        ClaimReaper(ctx.store, m.claim_deadline_s, m.claim_sweep_interval_s),
    ]
