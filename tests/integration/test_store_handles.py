"""The handle lifecycle against a real etcd (DESIGN.md invariants 1 and 2)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from typing import Any

import grpc
import pytest

from kvplane.services.common.model.errors import HandleNotRetained, NodeNotRegistered, NotFound
from kvplane.services.common.model.handles import CacheHandle, HandleState, KvTier, ReleaseReason
from kvplane.services.common.store import Store
from kvplane.services.common.store.etcd import Ambiguous
from kvplane.services.common.store.records import HandleReplaced
from kvplane.services.common.store.settings import StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import make_node
from tests.support.factories import make_handle
from tests.support.polling import eventually


async def test_publish_get_checkout_returns_the_handle_exactly_once(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    published = (await store.publish_handle(make_handle(node))).handle

    view = await store.get_handle("acme", "conv-1")
    assert view is not None and view.state is HandleState.RETAINED
    assert view.handle == published

    checkout = await store.check_out("acme", "conv-1", route_id="r1")
    assert checkout.handle == published
    with pytest.raises(NotFound):
        await store.check_out("acme", "conv-1", route_id="r2")
    after = await store.get_handle("acme", "conv-1")
    assert after is not None and after.state is HandleState.CHECKED_OUT


async def test_hundred_concurrent_checkouts_of_one_handle_give_exactly_one_success(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node))
    record = await store.get_handle_record("acme", "conv-1")
    assert record is not None

    results = await asyncio.gather(
        *[store.check_out("acme", "conv-1", route_id=f"r{i}", expected=record) for i in range(100)],
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(e, HandleNotRetained) for e in losers)


async def test_a_check_out_of_a_replaced_handle_names_the_one_retained_now(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, request_id="turn-1"))
    old = await store.get_handle_record("acme", "conv-1")
    assert old is not None
    newer = (await store.publish_handle(make_handle(node, request_id="turn-2", tokens=range(1, 513)))).handle
    with pytest.raises(HandleReplaced) as raised:
        await store.check_out("acme", "conv-1", route_id="r1", expected=old)
    # The failed check-out's own read, at its revision: it can be checked out at once.
    assert raised.value.current.handle == newer
    checked = await store.check_out("acme", "conv-1", route_id="r2", expected=raised.value.current)
    assert checked.handle == newer
    # Taken, not replaced: the same record again is plainly not retained.
    with pytest.raises(HandleNotRetained) as again:
        await store.check_out("acme", "conv-1", route_id="r3", expected=raised.value.current)
    assert not isinstance(again.value, HandleReplaced)


async def test_checked_out_handle_cannot_be_released(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node))
    record = await store.get_handle_record("acme", "conv-1")
    assert record is not None
    await store.check_out("acme", "conv-1", expected=record)

    # Through the fenced path with the revision read before the check-out...
    with pytest.raises(HandleNotRetained):
        await store.release("acme", "conv-1", ReleaseReason.LOW_VALUE, expected=record)
    # ...and through a fresh read.
    with pytest.raises(NotFound):
        await store.release("acme", "conv-1", ReleaseReason.LOW_VALUE)
    assert await store.pending_releases(node.node_id) == []


async def test_release_queues_a_command_and_removes_the_handle_first(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    handle = (await store.publish_handle(make_handle(node))).handle
    pending = await store.release("acme", "conv-1", ReleaseReason.NODE_BUDGET)
    assert pending.handle == handle
    assert await store.get_handle("acme", "conv-1") is None
    queued = await store.pending_releases(node.node_id)
    assert [p.command_id for p, _ in queued] == [pending.command_id]
    await store.ack_release(node.node_id, pending.command_id)
    assert await store.pending_releases(node.node_id) == []


async def test_newer_handle_supersedes_and_releases_the_older(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    first = (await store.publish_handle(make_handle(node, request_id="turn-1"))).handle
    outcome = await store.publish_handle(make_handle(node, request_id="turn-2"))
    assert outcome.superseded is not None and outcome.superseded.handle == first
    assert outcome.superseded.reason is ReleaseReason.SUPERSEDED
    # The old request's index entry is gone; the new one answers release reports.
    assert await store.release_freed(node.node_id, node.incarnation, ["turn-1"]) == 0
    assert await store.release_freed(node.node_id, node.incarnation, ["turn-2"]) == 1
    assert await store.get_handle("acme", "conv-1") is None


@pytest.mark.parametrize("then", ["checked_out", "released", "superseded"])
async def test_a_publish_re_sent_after_its_handle_left_retention_stores_nothing(
    store: Store, then: str
) -> None:
    """The node agent re-sends a publish whose answer was lost (a cut connection): by then the
    handle it stored may have been handed out, released or superseded. Stored again, it would be
    handed out a second time, or stay indexed on blocks its holder is told to free."""
    node = make_node()
    await store.register_node(node, 30)
    handle = (await store.publish_handle(make_handle(node, request_id="turn-1"))).handle
    if then == "checked_out":
        await store.check_out("acme", "conv-1", route_id="r1")
    elif then == "released":
        await store.release("acme", "conv-1", ReleaseReason.NODE_BUDGET)
    else:
        await store.publish_handle(make_handle(node, request_id="turn-2"))
    before = await store.get_handle("acme", "conv-1")
    commands = await store.pending_releases(node.node_id)

    outcome = await store.publish_handle(handle)

    assert outcome.freed and outcome.superseded is None
    assert await store.get_handle("acme", "conv-1") == before
    assert await store.pending_releases(node.node_id) == commands, "no newer handle released"
    index = store.keys.by_node(node.node_id, node.incarnation, "turn-1")
    assert not await store.etcd.exists(index), "nothing indexed on the blocks"


async def test_publish_requires_the_registered_incarnation(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    stale = make_handle(node)
    await store.register_node(make_node(node.node_id, incarnation="next-life"), 30)
    with pytest.raises(NodeNotRegistered):
        await store.publish_handle(stale)


async def test_handle_disappears_when_its_lease_expires(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node, life_ms=1500))

    async def gone() -> bool:
        return await store.get_handle("acme", "conv-1") is None

    await eventually(gone, timeout_s=10, what="handle lease expiry")
    assert (
        await store.release_freed(node.node_id, node.incarnation, [make_handle(node).vllm.remote_request_id])
        == 0
    )


async def test_node_and_all_its_handles_go_when_its_lease_expires(store: Store) -> None:
    node = make_node()
    other = make_node("d1")
    await store.register_node(node, 2)
    await store.register_node(other, 30)
    for i in range(5):
        await store.publish_handle(make_handle(node, conversation=f"c{i}"))
    await store.publish_handle(make_handle(other, conversation="kept"))

    async def node_gone() -> bool:
        return await store.get_node(node.node_id) is None

    await eventually(node_gone, timeout_s=10, what="node lease expiry")
    # The purge runs through the per-node index; it is what the reaper calls.
    assert await store.orphaned_nodes() == {(node.node_id, node.incarnation)}
    assert await store.purge_node(node.node_id, node.incarnation, ReleaseReason.HOLDER_DOWN) == 5
    for i in range(5):
        assert await store.get_handle("acme", f"c{i}") is None
    assert await store.get_handle("acme", "kept") is not None
    assert await store.orphaned_nodes() == set()


async def test_new_incarnation_retires_the_old_ones_handles(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    await store.publish_handle(make_handle(node))
    await store.register_node(make_node(node.node_id, incarnation="reborn"), 30)
    assert await store.get_handle("acme", "conv-1") is None


async def test_ambiguous_checkout_is_resolved_by_reading_the_claim_back(etcd: LocalEtcd, prefix: str) -> None:
    """etcd is frozen while the check-out is in flight: the client times out,
    the request still applies when etcd resumes, and the store reports the
    check-out as the success it was."""
    setup = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await setup.connect()
    node = make_node()
    await setup.register_node(node, 60)
    await setup.publish_handle(make_handle(node))
    record = await setup.get_handle_record("acme", "conv-1")
    assert record is not None
    # Connected before the freeze, so the frozen phase only sees the check-out txn.
    flaky = Store(
        StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix, request_timeout_s=0.3, settle_timeout_s=20)
    )
    await flaky.connect()
    await flaky.revision()
    assert etcd.proc is not None
    pid = etcd.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        attempt = asyncio.create_task(flaky.check_out("acme", "conv-1", route_id="r", expected=record))
        # Let at least one attempt time out against the frozen server.
        await eventually(_has_errors(flaky), timeout_s=60, what="a timed-out attempt")
    finally:
        os.kill(pid, signal.SIGCONT)
    checkout = await attempt
    assert checkout.handle.handle_id == record.handle.handle_id
    view = await setup.get_handle("acme", "conv-1")
    assert view is not None and view.state is HandleState.CHECKED_OUT
    await flaky.close()
    await setup.close()


def _has_errors(store: Store):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        samples = store.telemetry.registry.get_sample_value("kvplane_etcd_errors_total", {"op": "check_out"})
        return bool(samples)

    return probe


async def test_publish_takes_a_new_lease_when_its_resent_transaction_finds_the_lease_gone(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node()
    await store.register_node(node, 30)
    etcd = store.handles.etcd
    real_txn = etcd.txn
    revoked: list[int] = []

    async def reply_lost_then_lease_gone(op: str, compare: Any, ops: Any, **attrs: Any) -> Any:
        if op == "publish" and not revoked:
            # The first attempt's reply is lost, and its handle lease ends before the re-send.
            revoked.append(int(ops[0].request_put.lease))
            await store.revoke_lease(revoked[0])
            lost = grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "reply lost"
            )
            raise Ambiguous(op, lost)
        return await real_txn(op, compare, ops, **attrs)

    monkeypatch.setattr(etcd, "txn", reply_lost_then_lease_gone)
    published = (await asyncio.wait_for(store.publish_handle(make_handle(node)), 30)).handle
    record = await store.get_handle_record("acme", "conv-1")
    assert record is not None and record.handle == published
    assert revoked and record.lease != revoked[0]


def _moved_to_host(handle: CacheHandle, block_ids: list[int]) -> CacheHandle:
    """`handle`'s KV as its holder moves it to host memory: same request, new blocks."""
    vllm = dataclasses.replace(handle.vllm, remote_block_ids=(tuple(block_ids),))
    return dataclasses.replace(
        handle, handle_id="", vllm=vllm, tier=KvTier.HOST, relocates_handle_id=handle.handle_id
    )


async def test_a_relocation_replaces_the_retained_handle_without_releasing_it(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    handle = (await store.publish_handle(make_handle(node, request_id="turn-1"))).handle

    outcome = await store.publish_handle(_moved_to_host(handle, [900, 901]))

    assert not outcome.relocation_refused and outcome.superseded is None
    view = await store.get_handle("acme", "conv-1")
    assert view is not None and view.state is HandleState.RETAINED
    assert view.handle.tier is KvTier.HOST and view.handle.relocates_handle_id == ""
    assert view.handle.vllm.remote_block_ids == ((900, 901),)
    assert view.handle.handle_id not in ("", handle.handle_id)
    # Nothing is sent to the holder: the blocks moved, none were freed.
    assert await store.pending_releases(node.node_id) == []
    # The request's index entry is the moved handle's: the holder's release report removes it.
    assert await store.release_freed(node.node_id, node.incarnation, ["turn-1"]) == 1
    assert await store.get_handle("acme", "conv-1") is None


@pytest.mark.parametrize("first", ["checked_out", "released", "superseded"])
async def test_a_relocation_of_a_handle_no_longer_retained_is_refused_and_stores_nothing(
    store: Store, first: str
) -> None:
    node = make_node()
    await store.register_node(node, 30)
    handle = (await store.publish_handle(make_handle(node, request_id="turn-1"))).handle
    newer = None
    if first == "checked_out":
        await store.check_out("acme", "conv-1", route_id="r1")
    elif first == "released":
        await store.release("acme", "conv-1", ReleaseReason.NODE_BUDGET)
    else:
        newer = (await store.publish_handle(make_handle(node, request_id="turn-2"))).handle
    before = await store.get_handle("acme", "conv-1")

    outcome = await store.publish_handle(_moved_to_host(handle, [900, 901]))

    assert outcome.relocation_refused
    assert await store.get_handle("acme", "conv-1") == before
    if newer is not None:
        assert before is not None and before.handle == newer


async def test_a_relocation_must_keep_the_holder_and_the_request(store: Store) -> None:
    node = make_node()
    await store.register_node(node, 30)
    handle = (await store.publish_handle(make_handle(node, request_id="turn-1"))).handle
    other_request = dataclasses.replace(
        _moved_to_host(handle, [900]), vllm=make_handle(node, request_id="turn-9").vllm
    )

    assert (await store.publish_handle(other_request)).relocation_refused
    view = await store.get_handle("acme", "conv-1")
    assert view is not None and view.handle == handle
