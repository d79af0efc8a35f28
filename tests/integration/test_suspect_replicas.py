"""A routing replica that misses a health check is skipped until a background probe finds it
serving again; one that answers is never marked."""

from __future__ import annotations

import grpc

from kvplane.services.client.suspect_replicas import SuspectReplicas
from kvplane.services.common.runtime.auth import TokenAuthenticator
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.server import GrpcServer
from kvplane.services.common.runtime.telemetry import Telemetry
from tests.support.polling import eventually


async def test_a_silent_replica_is_skipped_until_it_serves_again() -> None:
    live = GrpcServer("127.0.0.1:0", Telemetry.disabled(), TokenAuthenticator({}))
    live_port = await live.start()
    silent_port = free_port()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in (live_port, silent_port)]
    suspects = SuspectReplicas(channels, ["a", "b"], "", probe_timeout_s=1.0, probe_interval_s=0.05)
    revived: GrpcServer | None = None
    try:
        assert await suspects.check(0) and 0 not in suspects
        assert not await suspects.check(1)
        assert suspects.indexes == {1}

        suspects.mark(1)  # marking again starts no second probe
        assert suspects.indexes == {1}

        revived = GrpcServer(f"127.0.0.1:{silent_port}", Telemetry.disabled(), TokenAuthenticator({}))
        await revived.start()

        async def cleared() -> bool:
            return 1 not in suspects

        await eventually(cleared, timeout_s=30, what="the revived replica no longer skipped")
    finally:
        await suspects.close()
        for channel in channels:
            await channel.close()
        await live.stop(0.1)
        if revived is not None:
            await revived.stop(0.1)
