"""kvplane.services.client against real routing replicas: failover, deadlines, trace propagation, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.services.client import RoutingClient, RoutingUnavailable
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import tenant_headers
from tests.support.routing_cluster import (
    HISTORY_TOKENS,
    MODEL,
    RoutingCluster,
    decode_params,
    homed_at,
    node,
    tokens,
)


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    c = RoutingCluster(etcd, prefix, store)
    try:
        await c.register(node("p0", NodeRole.PREFILL))
        await c.register(node("d0", NodeRole.DECODE))
        yield c
    finally:
        await c.stop()
        await store.close()


async def test_unavailable_replica_is_skipped_for_the_next(cluster: RoutingCluster) -> None:
    await cluster.add_replica()
    await cluster.wait_nodes()
    dead = f"127.0.0.1:{free_port()}"
    async with RoutingClient(
        [dead, cluster.target(0)], metadata=tenant_headers("acme"), timeout_s=5.0, attempts=2
    ) as client:
        for _ in range(3):
            # Its home is the dead replica.
            result = await client.route(homed_at(0, 2), MODEL, prompt_tokens=10)
            assert result.decision == "recompute_no_handle" and result.replica == 1


async def test_a_conversations_routes_go_to_its_home_replica_and_conversations_spread(
    cluster: RoutingCluster,
) -> None:
    for _ in range(3):
        await cluster.add_replica()
    await cluster.wait_nodes()
    async with cluster.client("acme") as client:
        homes: dict[str, set[int]] = {}
        # 11 conversations: not a multiple of the replicas, so that rotation would not send a
        # conversation's turns to one replica by chance.
        for turn in range(3):
            for i in range(11):
                result = await client.route(f"conv-{i}", MODEL, prompt_tokens=10 + turn)
                homes.setdefault(f"conv-{i}", set()).add(result.replica)
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert set().union(*homes.values()) == {0, 1, 2}, homes


async def test_all_replicas_down_fails_within_the_deadline(cluster: RoutingCluster) -> None:
    targets = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    async with RoutingClient(targets, timeout_s=0.5, attempts=5) as client:
        started = time.monotonic()
        with pytest.raises(RoutingUnavailable):
            await client.route("c", MODEL, prompt_tokens=10)
        assert time.monotonic() - started < 2.0


async def test_route_span_joins_the_gateways_trace_and_names_the_reason(cluster: RoutingCluster) -> None:
    server_spans = InMemorySpanExporter()
    await cluster.add_replica(telemetry=Telemetry.create("routing", exporter=server_spans))
    await cluster.wait_nodes()
    client_spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(client_spans))
    async with cluster.client("acme", tracer_provider=provider) as client:
        with provider.get_tracer("gateway").start_as_current_span("turn") as turn:
            await client.route("traced", MODEL, prompt_tokens=10)
        trace_id = turn.get_span_context().trace_id
    telemetry = cluster.replicas[0].telemetry
    deadline = time.monotonic() + 10
    route_spans = []
    while time.monotonic() < deadline and not route_spans:
        telemetry.tracer_provider.force_flush()
        route_spans = [s for s in server_spans.get_finished_spans() if s.name.endswith("/Route")]
    assert route_spans, [s.name for s in server_spans.get_finished_spans()]
    span = route_spans[0]
    assert span.context.trace_id == trace_id
    assert span.attributes is not None
    assert span.attributes["kvplane.decision"] == "recompute_no_handle"
    assert span.attributes["kvplane.reason"]


async def test_metrics_count_routes_by_decision_and_reason_and_tokens(cluster: RoutingCluster) -> None:
    replica = await cluster.add_replica()
    await cluster.wait_nodes()
    registry = replica.telemetry.registry
    history = tokens(HISTORY_TOKENS)
    async with cluster.client("acme") as client:
        # A long answer: P's prefix cache holds only the first prompt, so the history is pulled.
        first = await client.route("m1", MODEL, prompt_token_ids=history[:1000])
        handle_id = await cluster.report(
            "acme",
            "m1",
            decode_params(cluster.nodes["d0"], history),
            route=first,
            prompt_tokens=1000,
            prefill_ms=150.0,
        )
        await cluster.wait_handle("acme", "m1", handle_id)
        await client.route("m1", MODEL, prompt_token_ids=[*history, 1])

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert value("kvplane_routes_total", decision="pull", reason="pull") == 1
    assert value("kvplane_routes_total", decision="recompute", reason="recompute_no_handle") == 1
    assert value("kvplane_route_tokens_total", kind="reused") == HISTORY_TOKENS
    assert value("kvplane_route_tokens_total", kind="recomputed") == 1000 + 1
    assert value("kvplane_handle_life_left_at_checkout_seconds_count") == 1
    assert value("kvplane_turn_reports_total", outcome="success", published="true") == 1
    assert value("kvplane_cost_recompute_seconds_per_token") != 0.032 / 1000
    # No report said how long its pull took: the pull's figures are still the prior's.
    assert value("kvplane_cost_transfer_overhead_seconds") == 0.010


async def test_a_turn_sent_off_its_home_prefill_node_says_why_in_its_span_and_is_counted(
    cluster: RoutingCluster,
) -> None:
    await cluster.register(node("p1", NodeRole.PREFILL))
    server_spans = InMemorySpanExporter()
    replica = await cluster.add_replica(telemetry=Telemetry.create("routing", exporter=server_spans))
    await cluster.wait_nodes()
    history = tokens(1000)
    async with cluster.client("acme") as client:
        first = await client.route("mover", MODEL, prompt_token_ids=history)
        home = first.prefill.node_id
        other = "p1" if home == "p0" else "p0"
        # The home's queue (100,000 tokens: seconds of prefill) outweighs its cache of the history.
        await cluster.report_load(home, queued_prefill_tokens=100_000)
        await cluster.report_load(other, queued_prefill_tokens=0)
        await cluster.wait_views(lambda v: {"p0", "p1"} <= set(v.loads), "loads in the view")
        moved = await client.route("mover", MODEL, prompt_token_ids=[*history, *tokens(50, seed=2)])
        assert moved.prefill.node_id == other
        stayed = await client.route("stayer", MODEL, prompt_token_ids=tokens(200, seed=3))
    deadline = time.monotonic() + 10
    spans: dict[str, dict[str, object]] = {}
    while time.monotonic() < deadline and len(spans) < 3:
        replica.telemetry.tracer_provider.force_flush()
        spans = {
            str(s.attributes["kvplane.route_id"]): dict(s.attributes)
            for s in server_spans.get_finished_spans()
            if s.attributes and "kvplane.route_id" in s.attributes
        }
    assert str(spans[moved.route_id]["kvplane.moved_from"]).startswith(f"moved from {home} (queue ")
    assert "kvplane.moved_from" not in spans[first.route_id]
    assert "kvplane.moved_from" not in spans[stayed.route_id]
    registry = replica.telemetry.registry
    assert registry.get_sample_value("kvplane_route_prefill_moves_total") == 1
