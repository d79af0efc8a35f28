"""Claims nobody used are released; claims on blocks that were read are not; blocks the holder
freed are never published again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.store import Store
from kvplane.services.common.store.records import FreedBlocks, now_ms
from kvplane.v1 import handle_pb2
from tests.conftest import make_node
from tests.support.factories import make_handle

DEADLINE_MS = 60_000


async def _checked_out(store: Store, conversation: str = "c1") -> tuple[str, str, str]:
    node = make_node("d-claims")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation=conversation, request_id=f"req-{conversation}"))
    await store.check_out("acme", conversation)
    return node.node_id, node.incarnation, f"req-{conversation}"


async def test_a_claim_nobody_used_is_released_to_its_holder_past_the_deadline(store: Store) -> None:
    node_id, _, request_id = await _checked_out(store)
    assert await store.release_unused_claims(DEADLINE_MS) == [], "not before the deadline"

    released = await store.release_unused_claims(DEADLINE_MS, now_ms() + DEADLINE_MS + 1)
    assert [(p.handle.vllm.remote_request_id, p.reason) for p in released] == [
        (request_id, ReleaseReason.CLAIM_UNUSED)
    ]
    commands = await store.pending_releases(node_id)
    assert [p.handle.vllm.remote_request_id for p, _ in commands] == [request_id]
    assert await store.get_handle("acme", "c1") is None, "the claim is gone with its release"


async def test_a_claim_on_blocks_the_holder_freed_is_consumed_and_never_released(store: Store) -> None:
    node_id, incarnation, request_id = await _checked_out(store)
    # P read the blocks; D freed them and its agent reported it.
    await store.release_freed(node_id, incarnation, [request_id])

    assert await store.release_unused_claims(DEADLINE_MS, now_ms() + DEADLINE_MS + 1) == []
    assert await store.pending_releases(node_id) == []


async def test_replicas_sweeping_at_once_release_a_claim_once(store: Store) -> None:
    node_id, _, _ = await _checked_out(store)
    later = now_ms() + DEADLINE_MS + 1
    results = await asyncio.gather(*(store.release_unused_claims(DEADLINE_MS, later) for _ in range(4)))
    assert sum(len(r) for r in results) == 1
    assert len(await store.pending_releases(node_id)) == 1


async def test_a_late_publish_of_blocks_the_holder_already_freed_stores_nothing(store: Store) -> None:
    node = make_node("d-late")
    await store.register_node(node, 30)
    handle = make_handle(node, conversation="c-late", request_id="req-late")
    published = (await store.publish_handle(handle)).handle
    await store.check_out("acme", "c-late")
    # P read the blocks and D freed them; then a slow ReportTurn names the same handle again.
    await store.release_freed(node.node_id, node.incarnation, ["req-late"])

    outcome = await store.publish_handle(published)
    assert outcome.freed
    assert await store.get_handle_record("acme", "c-late") is None


@pytest.mark.parametrize("same_conversation", [False, True])
async def test_freed_blocks_reported_with_a_publish_drop_a_handle_still_retained_under_them(
    store: Store, same_conversation: bool
) -> None:
    """The engine freed a handle's blocks before anyone took them (its TTL); its next publish says
    so, for another conversation, or for the same one, whose handle it supersedes (the freed
    blocks' tombstone is then written once: etcd refuses a key put twice in one transaction)."""
    node = make_node("d-ride")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation="c-old", request_id="req-old"))
    freed = FreedBlocks(node.node_id, node.incarnation, ("req-old",))
    conversation = "c-old" if same_conversation else "c-new"

    outcome = await store.publish_handle(
        make_handle(node, conversation=conversation, request_id="req-new"), None, freed
    )

    assert outcome.handle.vllm.remote_request_id == "req-new" and not outcome.freed
    old = await store.get_handle("acme", "c-old")
    if same_conversation:
        assert old is not None and old.handle.vllm.remote_request_id == "req-new"
    else:
        assert old is None, "dropped, not handed out"
    assert (await store.publish_handle(make_handle(node, conversation="c-old", request_id="req-old"))).freed


async def test_a_publish_reported_with_its_own_blocks_freed_stores_nothing(store: Store) -> None:
    node = make_node("d-self")
    await store.register_node(node, 30)
    freed = FreedBlocks(node.node_id, node.incarnation, ("req-self",))
    outcome = await store.publish_handle(
        make_handle(node, conversation="c-self", request_id="req-self"), None, freed
    )
    assert outcome.freed
    assert await store.get_handle("acme", "c-self") is None


async def test_a_release_report_of_many_requests_fits_etcds_transaction_limit(store: Store) -> None:
    node = make_node("d-many")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation="c-many", request_id="req-0"))
    ids = [f"req-{i}" for i in range(1024)]
    assert await store.release_freed(node.node_id, node.incarnation, ids) == 1


async def test_a_check_out_stores_and_returns_the_handle_exactly_as_it_was_read(store: Store) -> None:
    node = make_node("d-whole")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation="c-whole", request_id="req-whole"))
    record = await store.get_handle_record("acme", "c-whole")
    assert record is not None

    checked = await store.check_out("acme", "c-whole", route_id="route-1", expected=record)

    returned = convert.handle_from_pb(handle_pb2.CacheHandle.FromString(checked.handle_pb))
    assert returned == record.handle == checked.handle
    claim_key = store.keys.claimed(node.node_id, node.incarnation, "req-whole")
    stored = await store.etcd.read("test_claim", rpc.RangeRequest(key=claim_key))
    claim = convert.claim_from_pb(handle_pb2.Claim.FromString(stored.kvs[0].value))
    assert (claim.claim_id, claim.route_id, claim.handle) == (checked.claim_id, "route-1", record.handle)
    assert claim.claimed_unix_ms > 0


async def test_the_ack_of_an_applied_release_records_its_blocks_freed_in_the_same_request(
    store: Store,
) -> None:
    node = make_node("d-acked")
    await store.register_node(node, 30)
    first = (await store.publish_handle(make_handle(node, conversation="c-acked", request_id="req-1"))).handle
    superseded = (
        await store.publish_handle(make_handle(node, conversation="c-acked", request_id="req-2"))
    ).superseded
    assert superseded is not None and superseded.handle == first

    retired = await _tombstone(store, node.node_id, node.incarnation, "req-1")
    assert retired is not None, "the supersession retired the blocks"

    await store.ack_release(node.node_id, superseded.command_id, (node.incarnation, "req-1"))
    assert await store.pending_releases(node.node_id) == []
    # Recorded freed: the tombstone lives on past the released handle's lease.
    freed = await _tombstone(store, node.node_id, node.incarnation, "req-1")
    assert freed is not None and freed.lease != retired.lease
    # No report from D followed: a late publish of the released blocks is refused all the same.
    outcome = await store.publish_handle(first)
    assert outcome.freed
    view = await store.get_handle("acme", "c-acked")
    assert view is not None and view.handle.vllm.remote_request_id == "req-2"


async def test_the_ack_of_a_release_the_node_could_not_apply_records_nothing(store: Store) -> None:
    node = make_node("d-unapplied")
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, conversation="c-un", request_id="req-1"))
    superseded = (
        await store.publish_handle(make_handle(node, conversation="c-un", request_id="req-2"))
    ).superseded
    assert superseded is not None

    retired = await _tombstone(store, node.node_id, node.incarnation, "req-1")

    await store.ack_release(node.node_id, superseded.command_id)
    assert await store.pending_releases(node.node_id) == []
    # The tombstone is the supersession's, untouched.
    assert retired is not None
    assert await _tombstone(store, node.node_id, node.incarnation, "req-1") == retired


async def _tombstone(store: Store, node_id: str, incarnation: str, request_id: str) -> Any:
    """The blocks' tombstone as etcd holds it (its key-value), or None."""
    key = store.keys.freed(node_id, incarnation, request_id)
    resp = await store.etcd.read("test_tombstone", rpc.RangeRequest(key=key))
    return resp.kvs[0] if resp.kvs else None
