"""Suspect marks: one short-lived key per node that just failed a leg."""

from __future__ import annotations

from kvplane.services.common.model.keys import KeyLayout
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import EtcdClient
from kvplane.services.common.store.leases import Leases


class SuspectStore:
    def __init__(self, etcd: EtcdClient, keys: KeyLayout, leases: Leases) -> None:
        self.etcd = etcd
        self.keys = keys
        self.leases = leases

    async def mark(self, suspect: NodeSuspect, ttl_s: int) -> None:
        """Marks the node suspect for at most `ttl_s` seconds (a newer mark replaces it)."""
        lease = await self.leases.grant(max(1, ttl_s))
        value = suspect.to_pb().SerializeToString()
        await self.etcd.write(
            "mark_suspect", [], [fencing.put(self.keys.suspect(suspect.node_id), value, lease)]
        )
