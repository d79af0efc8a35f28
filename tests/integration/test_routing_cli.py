"""`kvplane serve routing` as a real process: it answers Route and reports SERVING; `serve` with
services joined by commas serves those and no other."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _serving(etcd: LocalEtcd, prefix: str, services: str) -> Iterator[int]:
    """`kvplane serve <services>` on a free port, stopped at the end; its port."""
    port = free_port()
    env_prefix = {"KVPLANE_ETCD__PREFIX": prefix}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvplane.services.cli",
            "serve",
            services,
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
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def serve_routing(etcd: LocalEtcd, prefix: str) -> Iterator[tuple[int, str]]:
    with _serving(etcd, prefix, "routing") as port:
        yield port, prefix


async def _health(port: int, service: str) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    """The process's health status for `service`; SERVICE_UNKNOWN when it does not serve it."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            raise
        return reply.status


async def test_serve_runs_the_services_joined_by_commas_and_no_other(etcd: LocalEtcd, prefix: str) -> None:
    with _serving(etcd, prefix, "metadata,eviction") as port:

        async def serving() -> bool:
            try:
                statuses = [await _health(port, f"kvplane.v1.{s}Service") for s in ("Metadata", "Eviction")]
            except grpc.aio.AioRpcError:
                return False  # not listening yet
            return statuses == [health_pb2.HealthCheckResponse.SERVING] * 2

        await eventually(serving, timeout_s=30, interval_s=0.1, what="metadata and eviction SERVING")
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        assert await _health(port, "kvplane.v1.RoutingService") == unknown
        async with RoutingClient([f"127.0.0.1:{port}"], metadata=tenant_headers("acme")) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.route("c", MODEL, prompt_tokens=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


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
