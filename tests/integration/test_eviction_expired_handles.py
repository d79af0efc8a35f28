"""Handles past their expiry are not the coordinator's to release.

A handle's key lives until its shared lease's expiry bucket ends, up to 60 s after the
handle's own wall-clock expiry; in between, the engine frees the blocks itself, and a
release would only send the engine a command for blocks it no longer holds.
"""

from __future__ import annotations

from kvplane.services.common.store import Store
from kvplane.services.common.store.records import now_ms
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import make_node
from tests.support.eviction_nodes import coordinator_of, start_replica
from tests.support.factories import make_handle


async def test_a_handle_past_its_expiry_leaves_the_coordinators_snapshot(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    node = make_node("d0")
    await store.register_node(node, 60)
    replica = await start_replica(etcd, prefix)
    try:
        coordinator = coordinator_of(replica)
        published = (await store.publish_handle(make_handle(node, life_ms=600_000))).handle
        view = coordinator.view
        assert await view.wait_for(lambda: view.handle("acme", "conv-1") is not None, 10.0)

        live, _ = coordinator.snapshot(now_ms())
        assert [h.handle_id for h in live.handles] == [published.handle_id]
        expired, drains = coordinator.snapshot(published.wall_expiry_unix_ms)
        assert expired.handles == () and drains == []
    finally:
        await replica.stop()
