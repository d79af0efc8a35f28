"""Memory budgets enforced by the leader against real etcd, delivered to real streams."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Snapshot
from kvplane.services.eviction.policy.value import ValueModel
from kvplane.v1 import handle_pb2
from tests.conftest import make_node
from tests.support.eviction_nodes import CommandNode, coordinator_of, start_replica, target_of
from tests.support.factories import make_handle
from tests.support.polling import eventually

MB = 1 << 20


def aged_handle(node: Node, tenant: str, conversation: str, age_s: float, mb: int) -> CacheHandle:
    h = make_handle(node, tenant, conversation, life_ms=600_000, retained_bytes=mb * MB)
    return dataclasses.replace(h, published_unix_ms=int(time.time() * 1000 - age_s * 1000))


async def retained_by(store: Store, *, node_id: str = "", tenant: str = "") -> list[CacheHandle]:
    handles, _ = await store.list_handles(node_id=node_id, tenant=tenant, page_size=1000)
    return handles


def _info(h: CacheHandle) -> HandleInfo:
    return HandleInfo(
        h.tenant,
        h.conversation,
        h.handle_id,
        h.holder_node_id,
        h.retained_bytes,
        h.num_tokens,
        h.published_unix_ms,
        h.wall_expiry_unix_ms,
    )


def lowest_value(handles: Sequence[CacheHandle], count: int, capacity: int) -> set[str]:
    """The `count` lowest-value conversations, valued independently of the service."""
    infos = [_info(h) for h in handles]
    snap = Snapshot(int(time.time() * 1000), tuple(infos), {"d0": NodeInfo("d0", capacity)})
    return {h.conversation for h in ValueModel().lowest_value_first(infos, snap)[:count]}


async def test_a_node_over_budget_is_brought_under_its_low_watermark_lowest_value_first(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    node = make_node("d0")
    await store.register_node(node, 30)
    # 20 handles of 10 MB, idle 100 s to 2,000 s: 200 MB against a high mark
    # of 150 MB and a low mark of 100 MB, so exactly the 10 least valuable go.
    published = []
    for i in range(20):
        outcome = await store.publish_handle(aged_handle(node, "acme", f"c{i:02d}", 100 + 100 * i, 10))
        published.append(outcome.handle)
    expected = lowest_value(published, 10, node.kv_capacity_bytes)
    assert expected == {f"c{i:02d}" for i in range(10, 20)}  # the oldest, under the trace's prior

    agent = CommandNode(node.node_id, node.incarnation, [])
    policy = {"policies": [{"name": "node_budget", "high_bytes": 150 * MB, "low_bytes": 100 * MB}]}
    replica = await start_replica(etcd, prefix, policy=policy)
    agent.targets = [target_of(replica)]
    agent.start()
    try:
        await eventually(lambda: _true(len(agent.applied) >= 10), timeout_s=30, what="ten release commands")
        left = await retained_by(store, node_id="d0")
        assert sum(h.retained_bytes for h in left) <= 100 * MB
        got = {a.conversation for a in agent.applied.values()}
        assert got == expected, f"released {sorted(got)}, expected the lowest-value {sorted(expected)}"
        assert {a.reason for a in agent.applied.values()} == {handle_pb2.RELEASE_REASON_NODE_BUDGET}
        assert set(agent.released_handles.values()) == {1}
        await eventually(lambda: _empty(store.pending_releases("d0")), what="all acknowledged")
        # Under the high mark now: nothing more goes, however often it evaluates.
        coordinator = coordinator_of(replica)
        rounds = coordinator.evaluations
        await eventually(lambda: _true(coordinator.evaluations >= rounds + 3), what="more rounds")
        assert len(agent.applied) == 10
    finally:
        await agent.stop()
        await replica.stop()


async def test_per_tenant_budgets_are_enforced_and_other_tenants_untouched(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    nodes = [make_node("d0"), make_node("d1")]
    for n in nodes:
        await store.register_node(n, 30)
    for i in range(8):
        await store.publish_handle(aged_handle(nodes[i % 2], "small", f"s{i}", 60 + 60 * i, 10))
        await store.publish_handle(aged_handle(nodes[i % 2], "big", f"b{i}", 60 + 60 * i, 10))
    policy = {"policies": [{"name": "tenant_budget", "tenants": {"small": 40 * MB}, "low_ratio": 1.0}]}
    replica = await start_replica(etcd, prefix, policy=policy)
    agents = [CommandNode(n.node_id, n.incarnation, [target_of(replica)]) for n in nodes]
    for a in agents:
        a.start()
    try:
        await eventually(
            lambda: _true(sum(len(a.applied) for a in agents) >= 4), timeout_s=30, what="four releases"
        )
        small = await retained_by(store, tenant="small")
        assert sum(h.retained_bytes for h in small) <= 40 * MB
        assert {h.conversation for h in small} == {"s0", "s1", "s2", "s3"}  # the freshest stay
        assert len(await retained_by(store, tenant="big")) == 8
        # A new turn pushes the tenant over again: the leader reacts at once.
        await store.publish_handle(aged_handle(nodes[0], "small", "s-new", 1, 10))
        await eventually(
            lambda: _true(sum(len(a.applied) for a in agents) >= 5),
            timeout_s=2.0,
            what="the release after the new turn",
        )
        small = await retained_by(store, tenant="small")
        assert sum(h.retained_bytes for h in small) <= 40 * MB
        assert "s-new" in {h.conversation for h in small}
        released = [r for a in agents for r in a.applied.values()]
        assert {r.tenant for r in released} == {"small"}
        assert {r.reason for r in released} == {handle_pb2.RELEASE_REASON_TENANT_BUDGET}
    finally:
        for a in agents:
            await a.stop()
        await replica.stop()


async def _true(value: bool) -> bool:
    return value


async def _empty(awaitable) -> bool:  # type: ignore[no-untyped-def]
    return not await awaitable


async def test_every_release_carries_its_reason_as_metric_label_span_attribute_and_log_line(
    etcd: LocalEtcd, prefix: str, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    node = make_node("d0")
    await store.register_node(node, 30)
    for i in range(4):
        await store.publish_handle(aged_handle(node, "acme", f"c{i}", 100 + 100 * i, 10))
    spans = InMemorySpanExporter()
    telemetry = Telemetry.create("eviction-test", exporter=spans)
    policy = {"policies": [{"name": "node_budget", "high_bytes": 30 * MB, "low_bytes": 20 * MB}]}
    caplog.set_level(logging.INFO, logger="kvplane.services.eviction.releaser")
    replica = await start_replica(etcd, prefix, policy=policy, telemetry=telemetry)
    try:
        coordinator = coordinator_of(replica)

        async def two_counted() -> bool:
            return (
                telemetry.registry.get_sample_value(
                    "kvplane_eviction_releases_total", {"reason": "node_budget", "policy": "node_budget"}
                )
                == 2.0
            )

        await eventually(two_counted, what="two releases counted by reason")
        telemetry.tracer_provider.force_flush()
        released = [s for s in spans.get_finished_spans() if s.name == "eviction.release"]
        assert len(released) == 2
        for span in released:
            attrs = span.attributes or {}
            assert attrs["kvplane.release.reason"] == "node_budget"
            assert attrs["kvplane.release.policy"] == "node_budget"
            assert attrs["kvplane.release.outcome"] == "released"
        lines = [r for r in caplog.records if r.getMessage().startswith("released handle")]
        assert len(lines) == 2
        assert {getattr(r, "reason", None) for r in lines} == {"node_budget"}
        assert all("over" in r.getMessage() or ">" in r.getMessage() for r in lines)
        assert coordinator.is_leader

        async def gauge_shows_the_rest() -> bool:
            value = telemetry.registry.get_sample_value(
                "kvplane_eviction_node_retained_bytes", {"node": "d0"}
            )
            return value == 20 * MB

        await eventually(gauge_shows_the_rest, what="the retained-bytes gauge at the low mark")
    finally:
        await replica.stop()


async def test_a_node_short_of_free_kv_gets_its_least_valuable_blocks_back(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    node = make_node("d0")  # 1 GiB of KV
    await store.register_node(node, 30)
    for i in range(10):
        await store.publish_handle(aged_handle(node, "acme", f"c{i}", 100 + 100 * i, 10))
    policy = {"policies": [{"name": "kv_pressure", "low_free_fraction": 0.05, "target_free_fraction": 0.10}]}
    replica = await start_replica(etcd, prefix, policy=policy)
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    try:
        await eventually(lambda: _true(agent.connected), what="the node's stream")
        coordinator = coordinator_of(replica)
        rounds = coordinator.evaluations
        await eventually(lambda: _true(coordinator.evaluations >= rounds + 2), what="rounds with plenty free")
        assert agent.applied == {}
        # 2% free: 8% of 1 GiB (82 MB) must come back, so nine 10 MB handles.
        await store.report_load(
            NodeLoad(node.node_id, node.incarnation, free_kv_blocks=2, total_kv_blocks=100)
        )
        await eventually(lambda: _true(len(agent.applied) >= 9), timeout_s=30, what="nine releases")
        assert {a.conversation for a in agent.applied.values()} == {f"c{i}" for i in range(1, 10)}
        assert await store.get_handle_record("acme", "c0") is not None  # the freshest stays
    finally:
        await agent.stop()
        await replica.stop()
