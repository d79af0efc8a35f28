"""A process cut off from etcd says so: NOT_SERVING on its health service, one log line naming the
endpoint, and a Route that fails names etcd; SERVING again once etcd answers."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import routing_pb2, routing_pb2_grpc
from tests.conftest import OPERATOR_HEADERS, settings_for
from tests.support.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_follows_etcd_and_the_log_names_its_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    from kvplane.services.metadata.app import install as metadata
    from kvplane.services.routing.app import install as routing

    caplog.set_level(logging.WARNING, logger="kvplane.services.process")
    with LocalEtcd() as etcd:
        base = settings_for(etcd, "/health-test/")
        settings = base.model_copy(
            update={
                "etcd": base.etcd.model_copy(update={"unreachable_after_s": 1.0, "request_timeout_s": 0.5})
            }
        )
        process = ServiceProcess(settings, [metadata, routing], Telemetry.disabled())
        await process.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)

                async def status(service: str = "") -> int:
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    return int(reply.status)

                assert await status() == SERVING
                etcd.pause()  # SIGSTOP: connections hang, as with a partition
                await eventually(
                    lambda: _is(status(), NOT_SERVING),
                    timeout_s=60,
                    what="NOT_SERVING once etcd stops answering",
                )
                assert await status("kvplane.v1.RoutingService") == NOT_SERVING
                # Liveness is the process's, not etcd's: nothing restarts the control plane for it.
                assert await status("liveness") == SERVING
                lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
                assert len(lines) == 1 and etcd.endpoint in lines[0] and "NOT_SERVING" in lines[0]
                route = routing_pb2_grpc.RoutingServiceStub(channel).Route(
                    routing_pb2.RouteRequest(tenant="acme", conversation="c", model="tiny", prompt_tokens=64),
                    metadata=OPERATOR_HEADERS,
                    timeout=10,
                )
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await route
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert f"etcd at {etcd.endpoint} is not answering" in (failed.value.details() or "")
                etcd.resume()
                await eventually(
                    lambda: _is(status(), SERVING), timeout_s=60, what="SERVING once etcd answers again"
                )
        finally:
            etcd.resume()
            await process.stop()


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected
