"""A routing test cluster: nodes registered in a real etcd, routing replicas on free ports."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from kvplane.connector.digests import decode, digest_tokens, encode
from kvplane.services.client import RoutingClient
from kvplane.services.client.routing_client import home_replica
from kvplane.services.common.model.handles import KEY_DIGESTS, KEY_HANDLE_ID, CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings
from tests.conftest import OPERATOR_HEADERS, TEST_AUTH, tenant_headers

MODEL = "tiny"
BLOCK = 16
# Long enough that a pull is clearly cheaper than recomputing under the default cost model.
HISTORY_TOKENS = 4096


def node(
    node_id: str,
    role: NodeRole,
    *,
    host: str = "127.0.0.1",
    kv_dtype: str = "bfloat16",
    labels: dict[str, str] | None = None,
    kv_bytes_per_token: int = 4096,
) -> Node:
    url_host = f"[{host}]" if ":" in host else host
    return Node(
        node_id=node_id,
        incarnation=uuid.uuid4().hex,
        role=role,
        engine_id=f"engine-{node_id}-{uuid.uuid4().hex[:6]}",
        http_url=f"http://{url_host}:{8000 + len(node_id)}",
        side_channel_host=host,
        side_channel_port=5600,
        fingerprint=Fingerprint(MODEL, kv_dtype, "NHD"),
        block_size=BLOCK,
        kv_capacity_bytes=1 << 30,
        kv_bytes_per_token=kv_bytes_per_token,
        labels=labels or {},
    )


def homed_at(index: int, replicas: int, tenant: str = "") -> str:
    """A conversation whose Routes go first to replica `index` of `replicas`."""
    return next(c for i in range(1000) if home_replica(tenant, c := f"c-{i}", replicas) == index)


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(n)]


def decode_params(
    holder: Node,
    retained: Sequence[int],
    *,
    with_digests: bool = True,
    kvplane_connector: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """What a decode engine's connector returns at a natural finish. Without `kvplane_connector`,
    vLLM's own NixlConnector: no handle id announced (nothing publishes it) and no digests."""
    blocks = -(-len(retained) // holder.block_size)
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": holder.engine_id,
        "remote_request_id": f"cmpl-{uuid.uuid4().hex}",
        "remote_block_ids": [list(range(500, 500 + blocks))],
        "remote_num_tokens": len(retained),
        "remote_host": holder.side_channel_host,
        "remote_port": holder.side_channel_port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_blocks_expiry_time": 98765.4321,
        "remote_registration_generation": 3,
        "transfer_mode": "pull",
        "some_future_vllm_key": {"nested": [1, 2]},
        KEY_HANDLE_ID: uuid.uuid4().hex,
    }
    if not kvplane_connector:
        del params[KEY_HANDLE_ID]
    elif with_digests:
        params[KEY_DIGESTS] = encode(digest_tokens(retained, holder.block_size))
    params.update(extra)
    return params


def handle_for(
    holder: Node, tenant: str, conversation: str, retained: Sequence[int], *, life_ms: int = 120_000
) -> CacheHandle:
    params = decode_params(holder, retained)
    return CacheHandle(
        handle_id=params[KEY_HANDLE_ID],
        tenant=tenant,
        conversation=conversation,
        holder_node_id=holder.node_id,
        holder_incarnation=holder.incarnation,
        vllm=VllmHandle.from_kv_transfer_params(params),
        wall_expiry_unix_ms=int(time.time() * 1000) + life_ms,
        retained_bytes=len(retained) * holder.kv_bytes_per_token,
        digests=digest_tokens(retained, holder.block_size),
        model=MODEL,
    )


def routing_settings(
    endpoint: str,
    prefix: str,
    *,
    listen_host: str = "127.0.0.1",
    policy_file: str = "",
    routing: dict[str, Any] | None = None,
) -> KvplaneSettings:
    listen = f"[{listen_host}]" if ":" in listen_host else listen_host
    return KvplaneSettings.model_validate(
        {
            "grpc": {"listen": f"{listen}:{free_port(listen_host)}", "grace_s": 0.2},
            "etcd": {
                "endpoints": [endpoint],
                "prefix": prefix,
                "request_timeout_s": 1.0,
                "settle_timeout_s": 2.0,
            },
            "telemetry": {"metrics_port": 0, "json_logs": False},
            "routing": {"checkout_timeout_s": 1.0, "policy_file": policy_file, **(routing or {})},
            "auth": TEST_AUTH,
        }
    )


@dataclass
class RoutingCluster:
    """Nodes in etcd and one or more routing replicas over them."""

    etcd: LocalEtcd
    prefix: str
    store: Store
    replicas: list[ServiceProcess] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)
    leases: dict[str, int] = field(default_factory=dict)

    async def add_replica(
        self,
        listen_host: str = "127.0.0.1",
        telemetry: Telemetry | None = None,
        policy_file: str = "",
        routing: dict[str, Any] | None = None,
    ) -> ServiceProcess:
        """A routing replica; `routing` overrides settings of its RoutingSection."""
        from kvplane.services.routing.app import install

        process = ServiceProcess(
            routing_settings(
                self.etcd.endpoint,
                self.prefix,
                listen_host=listen_host,
                policy_file=policy_file,
                routing=routing,
            ),
            [install],
            telemetry or Telemetry.disabled(),
        )
        await process.start()
        self.replicas.append(process)
        return process

    def target(self, index: int = 0) -> str:
        process = self.replicas[index]
        host = process.settings.grpc.listen.rsplit(":", 1)[0]
        return f"{host}:{process.grpc_port}"

    def gateway(self, *indexes: int, **kwargs: Any) -> RoutingClient:
        """A client authenticated as an internal (operator) principal: it names tenants per call,
        and only it may publish a handle through ReportTurn."""
        targets = [self.target(i) for i in (indexes or range(len(self.replicas)))]
        kwargs.setdefault("timeout_s", 5.0)
        return RoutingClient(targets, metadata=OPERATOR_HEADERS, **kwargs)

    async def report(
        self,
        tenant: str,
        conversation: str,
        params: dict[str, Any],
        *indexes: int,
        engine_publishes: bool = True,
        **kwargs: Any,
    ) -> str:
        """D's finish reported by a trusted gateway; returns the published handle's id.

        Params that announce a handle id come from kvplane's connector, which publishes the handle
        itself: with `engine_publishes`, it is published here first, as the engine would, and
        awaited in every view. Routing publishes from the report only a handle no engine announced.
        """
        wanted = params.get(KEY_HANDLE_ID)
        if engine_publishes and isinstance(wanted, str) and wanted and kwargs.get("success", True):
            await self.publish(self.handle_from_params(tenant, conversation, params))
            await self.wait_handle(tenant, conversation, wanted)
        async with self.gateway(*indexes) as gateway:
            return await gateway.report_turn(
                kwargs.pop("route", None),
                conversation,
                success=True,
                decode_kv_transfer_params=params,
                tenant=tenant,
                **kwargs,
            )

    def client(self, tenant: str = "acme", *indexes: int, **kwargs: Any) -> RoutingClient:
        targets = [self.target(i) for i in (indexes or range(len(self.replicas)))]
        kwargs.setdefault("timeout_s", 5.0)
        return RoutingClient(targets, metadata=tenant_headers(tenant), **kwargs)

    async def register(self, n: Node, *, ttl_s: int = 300) -> Node:
        self.leases[n.node_id] = await self.store.register_node(n, ttl_s)
        self.nodes[n.node_id] = n
        return n

    async def report_load(self, node_id: str, **load: int) -> None:
        n = self.nodes[node_id]
        await self.store.report_load(
            NodeLoad(n.node_id, n.incarnation, reported_unix_ms=int(time.time() * 1000), **load)
        )

    async def kill_node(self, node_id: str) -> None:
        """The node's lease ends, as when its engine dies."""
        await self.store.revoke_lease(self.leases.pop(node_id))

    async def publish(self, handle: CacheHandle) -> CacheHandle:
        return (await self.store.publish_handle(handle)).handle

    def handle_from_params(self, tenant: str, conversation: str, params: dict[str, Any]) -> CacheHandle:
        """The handle D's connector publishes for `params` (its finish-time kv_transfer_params)."""
        vllm = VllmHandle.from_kv_transfer_params(params)
        holder = next(n for n in self.nodes.values() if n.engine_id == vllm.remote_engine_id)
        encoded = params.get(KEY_DIGESTS)
        return CacheHandle(
            handle_id=params[KEY_HANDLE_ID],
            tenant=tenant,
            conversation=conversation,
            holder_node_id=holder.node_id,
            holder_incarnation=holder.incarnation,
            vllm=vllm,
            wall_expiry_unix_ms=int(time.time() * 1000) + 120_000,
            retained_bytes=vllm.remote_num_tokens * holder.kv_bytes_per_token,
            digests=decode(encoded) if isinstance(encoded, str) and encoded else None,
            model=MODEL,
        )

    async def wait_views(self, predicate: Any, what: str, timeout_s: float = 10.0) -> None:
        """Waits until every replica's view satisfies `predicate(view)`."""
        for process in self.replicas:
            view = process.ctx.view
            if not await view.wait_for(lambda v=view: bool(predicate(v)), timeout_s):
                raise AssertionError(f"timed out waiting for {what}")

    async def wait_handle(self, tenant: str, conversation: str, handle_id: str | None = None) -> None:
        def present(view: Any) -> bool:
            record = view.handle(tenant, conversation)
            return record is not None and (handle_id is None or record.handle.handle_id == handle_id)

        await self.wait_views(present, f"handle of {tenant}/{conversation} in every view")

    async def wait_nodes(self) -> None:
        wanted = {(n.node_id, n.incarnation) for n in self.nodes.values() if n.node_id in self.leases}
        await self.wait_views(
            lambda v: wanted <= {(r.node.node_id, r.node.incarnation) for r in v.nodes.values()},
            "nodes in views",
        )

    async def stop(self) -> None:
        for process in self.replicas:
            await process.stop()
        self.replicas.clear()


def with_load_time(load: NodeLoad) -> NodeLoad:
    return replace(load, reported_unix_ms=int(time.time() * 1000))


@asynccontextmanager
async def prefill_and_decode(
    etcd: LocalEtcd, prefix: str, replicas: int = 1, routing: dict[str, Any] | None = None
) -> AsyncIterator[RoutingCluster]:
    """Prefill node p0, decode node d0 and `replicas` routing replicas whose views hold both
    (`routing`: overrides of their RoutingSection)."""
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    cluster = RoutingCluster(etcd, prefix, store)
    try:
        await cluster.register(node("p0", NodeRole.PREFILL))
        await cluster.register(node("d0", NodeRole.DECODE))
        for _ in range(replicas):
            await cluster.add_replica(routing=routing)
        await cluster.wait_nodes()
        yield cluster
    finally:
        await cluster.stop()
        await store.close()
