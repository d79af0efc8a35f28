"""Nodes: registration under a lease, keep-alives, loads and draining."""

from __future__ import annotations

from dataclasses import replace

from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import NodeNotRegistered, NotFound, StoreUnavailable
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.model.keys import KeyLayout, prefix_range_end
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient
from kvplane.services.common.store.leases import Leases
from kvplane.services.common.store.records import NodeRecord, now_ms
from kvplane.services.common.store.release_store import ReleaseStore
from kvplane.v1 import node_pb2


class NodeStore:
    def __init__(self, etcd: EtcdClient, keys: KeyLayout, leases: Leases, releases: ReleaseStore) -> None:
        self.etcd = etcd
        self.keys = keys
        self.leases = leases
        self.releases = releases

    async def register(self, node: Node, ttl_s: int) -> int:
        """Writes the node under a new lease. A previous incarnation is retired:
        its lease is revoked and its handles purged, so they are never served."""
        previous = await self.get(node.node_id)
        lease = await self.leases.grant(ttl_s)
        node = replace(node, registered_unix_ms=now_ms(), draining=False)
        put = fencing.put(self.keys.node(node.node_id), convert.node_to_pb(node).SerializeToString(), lease)
        try:
            await self.etcd.txn("register_node", [], [put], node=node.node_id)
        except Ambiguous as exc:
            # A put is idempotent: re-send until it is known to have applied.
            await self.etcd.resend(exc, lambda: self.etcd.txn("register_node", [], [put]))
        if previous is not None and previous.node.incarnation != node.incarnation:
            await self.leases.revoke(previous.lease)
            await self.releases.purge_node(node.node_id, previous.node.incarnation, ReleaseReason.HOLDER_DOWN)
        return lease

    async def get(self, node_id: str) -> NodeRecord | None:
        resp = await self.etcd.read("get_node", rpc.RangeRequest(key=self.keys.node(node_id)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return NodeRecord(convert.node_from_pb(node_pb2.Node.FromString(kv.value)), kv.lease, kv.mod_revision)

    async def registered(self, node_id: str, incarnation: str) -> NodeRecord:
        record = await self.get(node_id)
        if record is None or record.node.incarnation != incarnation:
            raise NodeNotRegistered(f"node {node_id!r} incarnation {incarnation!r} is not registered")
        return record

    async def keep_alive(
        self, node_id: str, incarnation: str, lease_id: int, hint: NodeRecord | None = None
    ) -> int:
        """Refreshes the node's lease once; returns its remaining TTL.

        `hint` (a watch-fed view's record of the node) that names this incarnation and lease
        saves the read: the refresh itself fails (NotFound) once the lease is gone.
        """
        if hint is None or hint.node.incarnation != incarnation or hint.lease != lease_id:
            record = await self.registered(node_id, incarnation)
            if record.lease != lease_id:
                raise NotFound(f"lease {lease_id:x} is not node {node_id!r}'s")
        return await self.leases.refresh(lease_id, "node_keepalive")

    async def report_load(self, load: NodeLoad, hint: NodeRecord | None = None) -> None:
        """Stores the node's load under its lease, fenced on its registration being unchanged.

        `hint` (a watch-fed view's record of the node) saves the read; a registration that
        changed since (drained, say) is read back in the transaction's failure branch.
        """
        record = hint if hint is not None and hint.node.incarnation == load.incarnation else None
        node_key = self.keys.node(load.node_id)
        value = convert.load_to_pb(load).SerializeToString()
        for _ in range(4):
            if record is None:
                record = await self.registered(load.node_id, load.incarnation)
            resp = await self.etcd.write(
                "report_load",
                [fencing.same_revision(node_key, record.mod_revision)],
                [fencing.put(self.keys.load(load.node_id), value, record.lease)],
                [fencing.get(node_key)],
            )
            if resp.succeeded:
                return
            kvs = resp.responses[0].response_range.kvs
            if not kvs:
                break
            node = convert.node_from_pb(node_pb2.Node.FromString(kvs[0].value))
            if node.incarnation != load.incarnation:
                break
            record = NodeRecord(node, int(kvs[0].lease), int(kvs[0].mod_revision))
        raise NodeNotRegistered(f"node {load.node_id!r} incarnation {load.incarnation!r} is not registered")

    async def set_draining(self, node_id: str, draining: bool = True) -> Node:
        for _ in range(8):
            record = await self.get(node_id)
            if record is None:
                raise NotFound(f"node {node_id!r} is not registered")
            node = replace(record.node, draining=draining)
            key = self.keys.node(node_id)
            put = fencing.put(key, convert.node_to_pb(node).SerializeToString(), record.lease)
            resp = await self.etcd.write(
                "drain_node", [fencing.same_revision(key, record.mod_revision)], [put]
            )
            if resp.succeeded:
                return node
        raise StoreUnavailable(f"node {node_id!r} kept changing while being drained")

    async def deregister(self, node_id: str, incarnation: str) -> None:
        record = await self.get(node_id)
        if record is None or record.node.incarnation != incarnation:
            raise NotFound(f"node {node_id!r} incarnation {incarnation!r} is not registered")
        await self.leases.revoke(record.lease)
        await self.releases.purge_node(node_id, incarnation, ReleaseReason.HOLDER_DOWN)

    async def list_nodes(self) -> tuple[int, list[tuple[NodeRecord, NodeLoad | None]]]:
        """Every node with its latest load, and the revision they were read at."""
        prefix = self.keys.nodes_prefix()
        loads_prefix = self.keys.loads_prefix()
        ops = [
            rpc.RequestOp(request_range=rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))),
            rpc.RequestOp(
                request_range=rpc.RangeRequest(key=loads_prefix, range_end=prefix_range_end(loads_prefix))
            ),
        ]
        resp = await self.etcd.read_txn("list_nodes", ops)
        loads: dict[str, NodeLoad] = {}
        for kv in resp.responses[1].response_range.kvs:
            reported = convert.load_from_pb(node_pb2.NodeLoad.FromString(kv.value))
            loads[reported.node_id] = reported
        out: list[tuple[NodeRecord, NodeLoad | None]] = []
        for kv in resp.responses[0].response_range.kvs:
            node = convert.node_from_pb(node_pb2.Node.FromString(kv.value))
            load = loads.get(node.node_id)
            if load is not None and load.incarnation != node.incarnation:
                load = None
            out.append((NodeRecord(node, kv.lease, kv.mod_revision), load))
        return int(resp.header.revision), out

    async def orphaned_nodes(self) -> set[tuple[str, str]]:
        """(node, incarnation) pairs that hold handles but are not registered."""
        prefix = self.keys.by_node_all_prefix()
        resp = await self.etcd.read(
            "orphan_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix), keys_only=True)
        )
        _, nodes = await self.list_nodes()
        live = {(r.node.node_id, r.node.incarnation) for r, _ in nodes}
        found = {self.keys.by_node_parts(kv.key)[:2] for kv in resp.kvs}
        return found - live
