"""`kvplane serve routing` as a real process: it answers Route and reports SERVING."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.services.client import RoutingClient
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import AUTH_ENV, tenant_headers
from tests.support.polling import eventually
from tests.support.routing_cluster import MODEL, node


@pytest.fixture
def serve_routing(etcd: LocalEtcd, prefix: str) -> Iterator[tuple[int, str]]:
    port = free_port()
    env_prefix = {"KVPLANE_ETCD__PREFIX": prefix}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvplane.services.cli",
            "serve",
            "routing",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd",
            etcd.endpoint,
            "--metrics-port",
            "0",
        ],
        env={**os.environ, **env_prefix, **AUTH_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield port, prefix
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_serve_routing_answers_route_and_health(
    etcd: LocalEtcd, serve_routing: tuple[int, str]
) -> None:
    port, prefix = serve_routing
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    try:
        await store.register_node(node("p0", NodeRole.PREFILL), 60)
        await store.register_node(node("d0", NodeRole.DECODE), 60)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def serving() -> bool:
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service="kvplane.v1.RoutingService"), timeout=1
                )
                return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

            await eventually(serving, timeout_s=30, interval_s=0.1, what="routing to report SERVING")
        async with RoutingClient([f"127.0.0.1:{port}"], metadata=tenant_headers("acme")) as client:

            async def routed() -> str:
                return (await client.route("c", MODEL, prompt_tokens=10)).decision

            assert await eventually(routed, timeout_s=10, what="a Route answer") == "recompute_no_handle"
    finally:
        await store.close()
