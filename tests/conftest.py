"""Shared fixtures: a real etcd per session, stores, and service processes on free ports."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings


@pytest.fixture(scope="session")
def etcd() -> Iterator[LocalEtcd]:
    server = LocalEtcd()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests share one etcd without sharing state."""
    return f"/kvplane-test/{uuid.uuid4().hex}/"


@pytest.fixture
async def store(etcd: LocalEtcd, prefix: str) -> AsyncIterator[Store]:
    s = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await s.connect()
    try:
        yield s
    finally:
        await s.close()


def settings_for(etcd: LocalEtcd, prefix: str, **sections: dict[str, object]) -> KvplaneSettings:
    values: dict[str, object] = {
        "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 0.5},
        "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix},
        "telemetry": {"metrics_port": free_port(), "json_logs": False},
        "auth": TEST_AUTH,
    }
    for key, value in sections.items():
        merged = dict(values.get(key, {}))  # type: ignore[call-overload]
        merged.update(value)
        values[key] = merged
    return KvplaneSettings.model_validate(values)


@pytest.fixture
async def metadata_process(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    from kvplane.services.metadata.app import install

    process = ServiceProcess(settings_for(etcd, prefix), [install], Telemetry.disabled())
    await process.start()
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
async def metadata_channel(metadata_process: ServiceProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{metadata_process.grpc_port}") as channel:
        yield channel


# Services under test run in mesh mode with a proxy secret; the calls below carry it, as a mesh
# proxy would. tests/integration/test_trust_boundary.py covers every mode. Mesh mode is experimental
# (THREAT_MODEL.md): the tests acknowledge it.
MESH_SECRET = "test-mesh-secret"
# Tenants call Route and CheckOutHandle themselves in these tests, as a gateway-less client does.
TEST_AUTH: dict[str, object] = {
    "mode": "mesh",
    "mesh_experimental": True,
    "mesh": {"secrets": [MESH_SECRET]},
    "tenants_see_engines": True,
}
# The same, for `kvplane serve` subprocesses.
AUTH_ENV = {
    "KVPLANE_AUTH__MODE": "mesh",
    "KVPLANE_AUTH__MESH_EXPERIMENTAL": "true",
    "KVPLANE_AUTH__MESH__SECRETS": f'["{MESH_SECRET}"]',
    "KVPLANE_AUTH__TENANTS_SEE_ENGINES": "true",
}
# What a node agent presents in these tests (ClientCredentials(mesh_secret=...)).
MESH_CREDENTIALS = ClientCredentials(mesh_secret=MESH_SECRET)


def node_headers(node_id: str = "d0") -> tuple[tuple[str, str], ...]:
    """A node principal acting as `node_id`."""
    return (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-role", "node"), ("x-kvplane-node", node_id))


NODE_HEADERS = node_headers("d0")
OPERATOR_HEADERS = (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-role", "operator"))


def tenant_headers(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("x-kvplane-mesh-secret", MESH_SECRET), ("x-kvplane-tenant", tenant))


def make_node(
    node_id: str = "d0",
    *,
    role: NodeRole = NodeRole.DECODE,
    incarnation: str | None = None,
    model: str = "tiny",
    host: str = "127.0.0.1",
    port: int = 8000,
) -> Node:
    url_host = f"[{host}]" if ":" in host else host
    return Node(
        node_id=node_id,
        incarnation=incarnation or uuid.uuid4().hex,
        role=role,
        engine_id=f"engine-{node_id}",
        http_url=f"http://{url_host}:{port}",
        side_channel_host=host,
        side_channel_port=5600,
        fingerprint=Fingerprint(model, "bfloat16", "NHD"),
        block_size=16,
        kv_capacity_bytes=1 << 30,
        kv_bytes_per_token=4096,
    )
