"""All of kvplane's etcd access: nodes, loads, handles, claims, releases,
elections and watches.

Every state change of a handle is one etcd transaction, fenced on the
handle key's mod_revision, so that concurrent check-outs, releases and
publishes of one conversation serialize in etcd and exactly one wins.

The plumbing (the connection and its calls, settling ambiguous writes,
leases, watches, the fencing ops) lives in `etcd`, `leases`, `watches` and
`fencing`; one small store per domain builds on it (`node_store`,
`handle_store`, `claim_store`, `release_store`, `election_store`). `Store`
puts them behind the one interface the services use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aetcd import rpc

from kvplane.services.common.model.errors import HandleNotRetained, NotFound
from kvplane.services.common.model.handles import CacheHandle, HandleState, PendingRelease, ReleaseReason
from kvplane.services.common.model.keys import KeyLayout
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store.claim_store import ClaimStore
from kvplane.services.common.store.election_store import ElectionStore
from kvplane.services.common.store.etcd import EtcdClient, LeaseNotFound
from kvplane.services.common.store.handle_store import HandleStore
from kvplane.services.common.store.leases import Leases
from kvplane.services.common.store.node_store import NodeStore
from kvplane.services.common.store.records import (
    CheckOut,
    ElectionRecord,
    FreedBlocks,
    HandleRecord,
    HandleView,
    NodeRecord,
    PublishHint,
    PublishOutcome,
    now_ms,
)
from kvplane.services.common.store.release_store import ReleaseStore
from kvplane.services.common.store.settings import StoreSettings
from kvplane.services.common.store.suspect_store import SuspectStore
from kvplane.services.common.store.watches import Compacted, Watches, WatchEvent

__all__ = [
    "CheckOut",
    "Compacted",
    "ElectionRecord",
    "FreedBlocks",
    "HandleRecord",
    "HandleView",
    "LeaseNotFound",
    "NodeRecord",
    "PublishHint",
    "PublishOutcome",
    "Store",
    "StoreSettings",
    "WatchEvent",
    "now_ms",
]


class Store:
    """kvplane's etcd store. One per process; safe for concurrent tasks."""

    def __init__(self, settings: StoreSettings, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.keys = KeyLayout(settings.prefix)
        self.telemetry = telemetry or Telemetry.disabled()
        self.etcd = EtcdClient(settings, self.telemetry)
        self.leases = Leases(self.etcd)
        self.watches = Watches(self.etcd)
        self.releases = ReleaseStore(self.etcd, self.keys, self.telemetry, self.leases)
        self.nodes = NodeStore(self.etcd, self.keys, self.leases, self.releases)
        self.handles = HandleStore(self.etcd, self.keys, self.leases, self.releases, self.telemetry)
        self.claims = ClaimStore(self.etcd, self.keys, self.telemetry, self.releases)
        self.elections = ElectionStore(self.etcd, self.keys)
        self.suspects = SuspectStore(self.etcd, self.keys, self.leases)

    # -- connection ---------------------------------------------------------

    async def connect(self) -> None:
        await self.etcd.connect()

    async def close(self) -> None:
        await self.etcd.close()

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def revision(self) -> int:
        """The store's current revision (a cheap read)."""
        resp = await self.etcd.read(
            "revision", rpc.RangeRequest(key=self.keys.prefix.encode(), limit=1, keys_only=True)
        )
        return int(resp.header.revision)

    # -- leases -------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        return await self.leases.grant(ttl_s)

    async def refresh_lease(self, lease_id: int) -> int:
        """Keeps a lease alive once; returns the remaining TTL. NotFound if it is gone."""
        return await self.leases.refresh(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        await self.leases.revoke(lease_id)

    # -- nodes --------------------------------------------------------------

    async def register_node(self, node: Node, ttl_s: int) -> int:
        """Writes the node under a new lease, retiring a previous incarnation."""
        return await self.nodes.register(node, ttl_s)

    async def get_node(self, node_id: str) -> NodeRecord | None:
        return await self.nodes.get(node_id)

    async def keep_alive(
        self, node_id: str, incarnation: str, lease_id: int, hint: NodeRecord | None = None
    ) -> int:
        """Refreshes the node's lease; `hint`, a view's record of the node, saves a read."""
        return await self.nodes.keep_alive(node_id, incarnation, lease_id, hint)

    async def report_load(self, load: NodeLoad, hint: NodeRecord | None = None) -> None:
        """Stores the node's load; `hint`, a view's record of the node, saves a read."""
        await self.nodes.report_load(load, hint)

    async def set_draining(self, node_id: str, draining: bool = True) -> Node:
        return await self.nodes.set_draining(node_id, draining)

    async def deregister_node(self, node_id: str, incarnation: str) -> None:
        await self.nodes.deregister(node_id, incarnation)

    async def list_nodes(self) -> tuple[int, list[tuple[NodeRecord, NodeLoad | None]]]:
        """Every node with its latest load, and the revision they were read at."""
        return await self.nodes.list_nodes()

    async def orphaned_nodes(self) -> set[tuple[str, str]]:
        """(node, incarnation) pairs that hold handles but are not registered."""
        return await self.nodes.orphaned_nodes()

    async def mark_suspect(self, suspect: NodeSuspect, ttl_s: int) -> None:
        """Marks a node that just failed a leg suspect, for every routing replica."""
        await self.suspects.mark(suspect, ttl_s)

    # -- handles ------------------------------------------------------------

    async def get_handle_record(self, tenant: str, conversation: str) -> HandleRecord | None:
        return await self.handles.get_record(tenant, conversation)

    async def get_handle(self, tenant: str, conversation: str) -> HandleView | None:
        """The retained handle, else the handle of the conversation's latest check-out while
        its claim lives."""
        record = await self.handles.get_record(tenant, conversation)
        if record is not None:
            return HandleView(record.handle, HandleState.RETAINED)
        claim = await self.claims.latest(tenant, conversation)
        return HandleView(claim.handle, HandleState.CHECKED_OUT) if claim is not None else None

    async def publish_handle(
        self, handle: CacheHandle, hint: PublishHint | None = None, freed: FreedBlocks | None = None
    ) -> PublishOutcome:
        """Stores `handle` as its conversation's handle, superseding an older one.

        `hint`: what a watch-fed view holds of the holder and the conversation, which saves
        the read; `freed`: blocks the holder's engine freed, recorded first, in the same
        transaction where they fit (see HandleStore.publish)."""
        return await self.handles.publish(handle, hint, freed)

    async def list_handles(
        self, *, tenant: str = "", node_id: str = "", page_size: int = 100, page_token: bytes = b""
    ) -> tuple[list[CacheHandle], bytes]:
        """One page of retained handles in key order, and the next page's start key."""
        return await self.handles.list(
            tenant=tenant, node_id=node_id, page_size=page_size, page_token=page_token
        )

    async def _retained(
        self, tenant: str, conversation: str, handle_id: str, expected: HandleRecord | None
    ) -> HandleRecord:
        record = expected or await self.handles.get_record(tenant, conversation)
        if record is None:
            raise NotFound(f"no retained handle for conversation {conversation!r}")
        if handle_id and record.handle.handle_id != handle_id:
            raise HandleNotRetained(f"handle {handle_id!r} is not the retained one")
        return record

    async def check_out(
        self,
        tenant: str,
        conversation: str,
        *,
        route_id: str = "",
        handle_id: str = "",
        expected: HandleRecord | None = None,
        claim_id: str = "",
    ) -> CheckOut:
        """Hands the conversation's handle to one caller, at most once.

        `expected` (from a watch-fed cache) saves the read. NotFound if there
        is no handle; HandleNotRetained if another caller won, or if
        `handle_id` names another handle.
        """
        record = await self._retained(tenant, conversation, handle_id, expected)
        return await self.claims.check_out(tenant, conversation, record, route_id=route_id, claim_id=claim_id)

    async def release(
        self,
        tenant: str,
        conversation: str,
        reason: ReleaseReason,
        *,
        handle_id: str = "",
        expected: HandleRecord | None = None,
    ) -> PendingRelease:
        """Releases the handle only if it is still retained (see ReleaseStore.release)."""
        record = await self._retained(tenant, conversation, handle_id, expected)
        return await self.releases.release(tenant, conversation, record, reason)

    async def release_freed(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> int:
        """Drops handles whose blocks the engine itself freed, and consumes the claims
        on them (a read, or D's own TTL); returns how many retained handles went."""
        return await self.releases.release_freed(node_id, incarnation, request_ids)

    async def release_unused_claims(self, deadline_ms: int, now: int | None = None) -> list[PendingRelease]:
        """Queues a release for every claim nobody consumed within `deadline_ms`."""
        return await self.claims.release_unused(deadline_ms, now if now is not None else now_ms())

    async def unreferenced(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> list[str]:
        """Of the request ids a node's engine retains, those nothing references."""
        return await self.releases.unreferenced(node_id, incarnation, request_ids)

    async def purge_node(self, node_id: str, incarnation: str | None, reason: ReleaseReason) -> int:
        """Removes every handle a node (or one of its incarnations) holds."""
        return await self.releases.purge_node(node_id, incarnation, reason)

    # -- release commands -----------------------------------------------------

    async def pending_releases(self, node_id: str) -> list[tuple[PendingRelease, int]]:
        """Release commands queued for a node, with their mod_revisions, oldest first."""
        return await self.releases.pending_releases(node_id)

    async def ack_release(self, node_id: str, command_id: str, freed: tuple[str, str] | None = None) -> None:
        await self.releases.ack_release(node_id, command_id, freed)

    # -- leader election -------------------------------------------------------

    async def campaign(self, name: str, candidate: str, lease: int) -> ElectionRecord:
        """Tries to make `candidate` the leader of `name` (see ElectionStore.campaign)."""
        return await self.elections.campaign(name, candidate, lease)

    async def election_leader(self, name: str) -> ElectionRecord | None:
        return await self.elections.leader(name)

    # -- watches --------------------------------------------------------------

    async def read_prefix(self, prefix: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key under `prefix` as put events, and the revision of the read."""
        return await self.watches.read_prefix(prefix)

    async def read_range(self, key: bytes, range_end: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key in [key, range_end) as put events, and the revision of the read."""
        return await self.watches.read_range(key, range_end)

    def watch_prefix(
        self, prefix: bytes, start_revision: int, *, prev_kv: bool = True
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes under `prefix` (see Watches.watch_range)."""
        return self.watches.watch_prefix(prefix, start_revision, prev_kv=prev_kv)

    def watch_range(
        self, key: bytes, range_end: bytes, start_revision: int, *, prev_kv: bool = True
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes in [key, range_end) (see Watches.watch_range)."""
        return self.watches.watch_range(key, range_end, start_revision, prev_kv=prev_kv)
