"""What the handle lifecycle costs etcd, request by request, against a real etcd.

Every unary etcd request the store makes goes through `EtcdClient.call`; the tests count
those calls by operation. A turn that pulls costs three (the check-out, the next handle's
publish, the holder's report that the pulled blocks are freed), and so does a turn whose new
handle supersedes one nobody took (the publish, the freed report, the release's ack).
Lease grants are shared by expiry bucket, so they are counted apart.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any

import pytest

from kvplane.services.common.model.errors import NotFound
from kvplane.services.common.model.handles import CacheHandle, HandleState, ReleaseReason
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.store import Store
from kvplane.services.common.store.leases import MAX_BUCKET_S
from kvplane.services.common.store.records import HandleRecord, NodeRecord, PublishHint, now_ms
from tests.conftest import make_node
from tests.support.factories import make_handle

# Far enough out that the expiry bucket stays at its largest for the whole test.
LIFE_MS = 900_000


def count_calls(store: Store, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    real = store.etcd.call

    async def counted(op: str, *args: Any, **kwargs: Any) -> Any:
        calls[op] += 1
        return await real(op, *args, **kwargs)

    monkeypatch.setattr(store.etcd, "call", counted)
    return calls


def without_grants(calls: Counter[str]) -> Counter[str]:
    return Counter({op: n for op, n in calls.items() if op != "lease_grant" and n})


async def registered(store: Store, name: str) -> tuple[Node, NodeRecord]:
    node = make_node(name)
    await store.register_node(node, 30)
    record = await store.get_node(node.node_id)
    assert record is not None
    return node, record


async def test_a_pulled_turn_costs_three_requests_and_a_superseding_turn_three(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, node_record = await registered(store, "d-requests")
    expiry = now_ms() + LIFE_MS

    def handle(conversation: str, turn: int) -> CacheHandle:
        h = make_handle(node, conversation=conversation, request_id=f"{conversation}-{turn}")
        return dataclasses.replace(h, wall_expiry_unix_ms=expiry)

    async def current(conversation: str) -> HandleRecord:
        # What a routing replica's view holds (read outside the counted calls).
        record = await store.get_handle_record("acme", conversation)
        assert record is not None
        return record

    calls = count_calls(store, monkeypatch)
    started = time.monotonic()
    conversations = [f"conv-{i}" for i in range(8)]
    for conversation in conversations:
        # Turn 1: the first handle, nothing to supersede.
        await store.publish_handle(handle(conversation, 1), PublishHint(node_record, None))
    assert without_grants(calls) == Counter(publish=8)
    records = {c: await current(c) for c in conversations}

    calls.clear()
    for conversation in conversations:
        # Turn 2 pulls: check-out, D's next handle, D's report that P read the pulled blocks.
        await store.check_out("acme", conversation, expected=records[conversation])
        await store.publish_handle(handle(conversation, 2), PublishHint(node_record, None))
        assert await store.release_freed(node.node_id, node.incarnation, [f"{conversation}-1"]) == 0
    assert without_grants(calls) == Counter(check_out=8, publish=8, release_freed=8)
    records = {c: await current(c) for c in conversations}

    calls.clear()
    for conversation in conversations:
        # Turn 3 recomputes: its handle supersedes turn 2's, whose release D applies and acks;
        # the ack records the freed blocks, so D sends no report of them.
        outcome = await store.publish_handle(
            handle(conversation, 3), PublishHint(node_record, records[conversation])
        )
        assert outcome.superseded is not None
        assert outcome.superseded.reason is ReleaseReason.SUPERSEDED
        await store.ack_release(
            node.node_id, outcome.superseded.command_id, (node.incarnation, f"{conversation}-2")
        )
    assert without_grants(calls) == Counter(publish=8, ack_release=8)

    # One lease for every handle of the expiry bucket; the tombstones' lease, one per bucket.
    elapsed = time.monotonic() - started
    assert calls["lease_grant"] <= 1 + int(elapsed // MAX_BUCKET_S) + 1
    # And the store holds what the lifecycle says: the last handles, no claims, no commands.
    for conversation in conversations:
        view = await store.get_handle("acme", conversation)
        assert view is not None and view.state is HandleState.RETAINED
        assert view.handle.vllm.remote_request_id == f"{conversation}-3"
    _, claims = await store.read_prefix(store.keys.all_claims_prefix())
    assert claims == []
    assert await store.pending_releases(node.node_id) == []


async def test_a_stale_hint_costs_one_more_transaction_and_no_read(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, node_record = await registered(store, "d-stale")
    first = (await store.publish_handle(make_handle(node, conversation="c", request_id="r1"))).handle
    calls = count_calls(store, monkeypatch)

    # The view has not seen the first handle yet: the publish finds it and supersedes it.
    outcome = await store.publish_handle(
        make_handle(node, conversation="c", request_id="r2"), PublishHint(node_record, None)
    )

    assert without_grants(calls) == Counter(publish=2)
    assert outcome.superseded is not None and outcome.superseded.handle == first
    record = await store.get_handle_record("acme", "c")
    assert record is not None and record.handle.vllm.remote_request_id == "r2"
    assert [p.handle.vllm.remote_request_id for p, _ in await store.pending_releases(node.node_id)] == ["r1"]


async def test_a_hint_that_misses_a_new_registration_reads_it_and_publishes(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, old_record = await registered(store, "d-restarted")
    new = make_node("d-restarted")
    await store.register_node(new, 30)
    calls = count_calls(store, monkeypatch)

    # The view still holds the previous incarnation's registration.
    outcome = await store.publish_handle(make_handle(new, conversation="c"), PublishHint(old_record, None))

    assert without_grants(calls) == Counter(publish_read=1, publish=1)
    assert outcome.handle.holder_incarnation == new.incarnation != old.incarnation


async def test_a_freed_report_drops_a_handle_still_retained_and_consumes_claims(store: Store) -> None:
    node, _ = await registered(store, "d-freed")
    await store.publish_handle(make_handle(node, conversation="kept", request_id="r-kept"))
    await store.publish_handle(make_handle(node, conversation="taken", request_id="r-taken"))
    await store.check_out("acme", "taken")
    assert (await store.get_handle("acme", "taken")).state is HandleState.CHECKED_OUT  # type: ignore[union-attr]

    # The engine freed both: one before anyone took it (its TTL), one after P read it.
    removed = await store.release_freed(node.node_id, node.incarnation, ["r-kept", "r-taken"])

    assert removed == 1
    assert await store.get_handle("acme", "kept") is None
    assert await store.get_handle("acme", "taken") is None
    _, claims = await store.read_prefix(store.keys.all_claims_prefix())
    assert claims == []
    # And neither can come back.
    late = await store.publish_handle(make_handle(node, conversation="kept", request_id="r-kept"))
    assert late.freed


async def test_handles_expiring_in_one_bucket_share_one_lease_that_outlives_them(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_calls(store, monkeypatch)
    end_s = (now_ms() + LIFE_MS) // 1000 // MAX_BUCKET_S * MAX_BUCKET_S
    expiries = [end_s * 1000 - k for k in range(0, MAX_BUCKET_S * 1000 - 1, 997)]
    leases = {await store.leases.for_expiry(e) for e in expiries}

    assert len(leases) == 1 and calls["lease_grant"] == 1
    ttl_s = await store.refresh_lease(leases.pop())
    assert ttl_s * 1000 >= max(expiries) - now_ms(), "the lease must cover its keys' whole life"


async def test_a_handle_past_its_expiry_is_never_checked_out_while_its_shared_lease_runs(
    store: Store,
) -> None:
    node, _ = await registered(store, "d-expired")
    await store.publish_handle(make_handle(node, conversation="old"))
    record = await store.get_handle_record("acme", "old")
    assert record is not None
    # The key lives until its lease's bucket ends, a little after the handle's own expiry.
    expired = HandleRecord(
        dataclasses.replace(record.handle, wall_expiry_unix_ms=now_ms() - 1),
        record.mod_revision,
        record.lease,
    )

    with pytest.raises(NotFound):
        await store.check_out("acme", "old", expected=expired)
    assert await store.get_handle_record("acme", "old") == record, "nothing was written"
