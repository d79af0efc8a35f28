"""Routing fed by prefill engines' own KV-cache events: StreamPrefixCache against real routing
replicas and etcd, and the node agent reading a real ZMQ publisher and streaming to them."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.node_agent import prefix_cache
from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.services.client import RoutingClient
from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.nodes import NodeLoad, NodeRole
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import routing_pb2, routing_pb2_grpc
from tests.conftest import OPERATOR_HEADERS, make_node, node_headers, tenant_headers
from tests.integration.test_node_agent import fast_settings, target_of
from tests.support.kv_event_publisher import EventPublisher, stored_chain
from tests.support.polling import eventually
from tests.support.routing_cluster import BLOCK, MODEL, RoutingCluster, node, prefill_and_decode, tokens

PROMPT = tokens(4096, seed=5)
STALE_S = 0.5
STREAM_MESSAGES = "kvplane_routing_node_stream_messages_total"


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix, routing={"prefix_cache_stale_after_s": STALE_S}) as c:
        p1 = await c.register(node("p1", NodeRole.PREFILL))
        await c.wait_nodes()
        # p1 has work queued: without knowing what its cache holds, p0 is the cheaper prefill node.
        await c.report_load("p1", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50)
        assert p1.incarnation
        yield c


class NodeStream:
    """A node's StreamPrefixCache call, fed message by message."""

    def __init__(self, cluster: RoutingCluster, node_id: str, as_node: str | None = None) -> None:
        self.node = cluster.nodes[node_id]
        self.queue: asyncio.Queue[routing_pb2.StreamPrefixCacheRequest | None] = asyncio.Queue()
        self.channel = grpc.aio.insecure_channel(cluster.target(0))
        stub = routing_pb2_grpc.RoutingServiceStub(self.channel)
        self.call = stub.StreamPrefixCache(self._messages(), metadata=node_headers(as_node or node_id))

    async def _messages(self) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
        while (message := await self.queue.get()) is not None:
            yield message

    def send(self, snapshot: bool, stored: list[int] = [], node_id: str = "") -> None:  # noqa: B006
        self.queue.put_nowait(
            routing_pb2.StreamPrefixCacheRequest(
                node_id=node_id or self.node.node_id,
                incarnation=self.node.incarnation,
                snapshot=snapshot,
                stored_block_ids=stored,
                block_size=BLOCK,
                hash_algo="sha256",
                hash_seed="vllm-none-hash",
                checkpoint_blocks=1,
            )
        )

    async def close(self) -> routing_pb2.StreamPrefixCacheResponse:
        self.queue.put_nowait(None)
        try:
            ack: routing_pb2.StreamPrefixCacheResponse = await self.call
            return ack
        finally:
            await self.channel.close()


def conv() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


async def prefill_of(client: RoutingClient, prompt: list[int], salt: str = "") -> str:
    result = await client.route(conv(), MODEL, prompt_token_ids=[*prompt, 7, 8, 9], cache_salt=salt)
    return result.prefill.node_id


async def test_a_fresh_view_sends_the_turn_to_the_node_that_holds_its_prefix_until_it_goes_stale(
    cluster: RoutingCluster,
) -> None:
    async with cluster.client("acme") as client:
        assert await prefill_of(client, PROMPT) == "p0"
        stream = NodeStream(cluster, "p1")
        stream.send(True, BlockHasher(BLOCK).ids(PROMPT))

        async def to_p1() -> bool:
            return await prefill_of(client, PROMPT) == "p1"

        await eventually(to_p1, what="the route to follow p1's view")

        # The node's stream goes quiet (its agent hung, the network split): past the staleness
        # bound routing goes back to its own record, which knows nothing of p1's cache.
        async def to_p0() -> bool:
            return await prefill_of(client, PROMPT) == "p0"

        await eventually(to_p0, interval_s=0.2, what="the stale view to be set aside")
        stream.send(False)  # a keep-alive: the view is fresh again
        await eventually(to_p1, what="the refreshed view to count")
        ack = await stream.close()
        assert ack.applied == 2


async def test_a_replica_with_engine_cache_events_off_routes_on_its_own_record(
    etcd: LocalEtcd, prefix: str
) -> None:
    # A view that stays fresh for the whole test: with events on, p1 would draw the turn.
    routing = {"engine_cache_events": False, "prefix_cache_stale_after_s": 300}
    async with prefill_and_decode(etcd, prefix, routing=routing) as cluster:
        await cluster.register(node("p1", NodeRole.PREFILL))
        await cluster.wait_nodes()
        await cluster.report_load("p1", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50)
        stream = NodeStream(cluster, "p1")
        stream.send(True, BlockHasher(BLOCK).ids(PROMPT))
        # The ack comes once the replica has handled every message: the snapshot was taken in
        # (and counted) but not believed.
        assert (await stream.close()).applied == 1
        registry = cluster.replicas[0].ctx.telemetry.registry
        assert registry.get_sample_value(STREAM_MESSAGES, {"kind": "cache"}) == 1
        async with cluster.client("acme") as client:
            assert await prefill_of(client, PROMPT) == "p0"


async def test_a_node_streams_only_for_its_own_node_id_and_tenants_not_at_all(
    cluster: RoutingCluster,
) -> None:
    impostor = NodeStream(cluster, "p1", as_node="p0")
    impostor.send(True, [1, 2, 3])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await impostor.close()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED

    switching = NodeStream(cluster, "p1")
    switching.send(True, [1])
    switching.send(False, [2], node_id="p0")
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await switching.close()
    assert invalid.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)

    for headers in (tenant_headers("acme"), OPERATOR_HEADERS):
        async with grpc.aio.insecure_channel(cluster.target(0)) as channel:
            stub = routing_pb2_grpc.RoutingServiceStub(channel)

            async def one() -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
                yield routing_pb2.StreamPrefixCacheRequest(
                    node_id="p1", incarnation="x", snapshot=True, block_size=BLOCK
                )

            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await stub.StreamPrefixCache(one(), metadata=headers)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
def agents() -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    for agent in started:
        agent.stop(timeout_s=5.0)


async def test_the_node_agent_streams_its_engine_s_events_and_routing_follows_them(
    cluster: RoutingCluster,
    metadata_process: ServiceProcess,
    agents: list[NodeAgent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hasher = BlockHasher(BLOCK)
    # Messages of at most 7 block ids: the prompt's 256 blocks go in 37 deltas.
    monkeypatch.setattr(prefix_cache, "MESSAGE_IDS", 7)
    async with EventPublisher() as publisher:
        source = KVEventsSource(publisher.endpoint, publisher.replay_endpoint, BLOCK, topic=publisher.topic)
        settings = fast_settings(target_of(metadata_process), routing_targets=(cluster.target(0),))
        agent_node = make_node("p-ev", role=NodeRole.PREFILL, incarnation="")
        agent = NodeAgent(
            settings,
            agent_node,
            lambda: NodeLoad("p-ev", "", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50),
            lambda _: None,
            kv_events=source,
        )
        agent.start()
        agents.append(agent)
        await publisher.subscribed()
        await cluster.wait_views(
            lambda v: "p-ev" in v.nodes and v.load(v.nodes["p-ev"].node) is not None,
            "the agent's node and its load",
        )
        async with cluster.client("acme") as client:
            # Its engine's events say nothing yet: its queue makes it the costlier prefill node.
            assert await prefill_of(client, PROMPT, salt="salt-acme") != "p-ev"
        # The engine computed the tenant's salted prompt: routing predicts the same block ids.
        await publisher.publish([stored_chain(hasher, PROMPT, cache_salt="salt-acme")])
        async with cluster.client("acme") as client:

            async def to_agent_node() -> bool:
                return await prefill_of(client, PROMPT, salt="salt-acme") == "p-ev"

            await eventually(to_agent_node, what="routing to follow the engine's events")
            # Another tenant's salt: those blocks are not its prefix.
            assert await prefill_of(client, PROMPT, salt="salt-other") != "p-ev"
        stats = agent.stats()
        assert stats.kv_event_batches == 1 and stats.kv_blocks == len(PROMPT) // BLOCK

        async def every_delta_sent() -> bool:
            # Routing may follow the events before the last of the deltas has gone.
            return agent.stats().prefix_cache_messages >= 1 + 37

        await eventually(every_delta_sent, what="the snapshot and the 37 deltas sent")
        registry = cluster.replicas[0].ctx.telemetry.registry

        async def every_delta_counted() -> bool:
            return (registry.get_sample_value(STREAM_MESSAGES, {"kind": "cache"}) or 0) >= 1 + 37

        await eventually(every_delta_counted, what="routing to count the snapshot and the deltas")
    agent.stop(timeout_s=5.0)

    async def stream_closed() -> bool:
        return registry.get_sample_value("kvplane_routing_node_streams") == 0

    await eventually(stream_closed, what="routing to count the agent's stream closed")


async def test_a_node_without_kv_events_streams_its_load_and_etcd_hears_only_its_memory(
    cluster: RoutingCluster,
    metadata_process: ServiceProcess,
    agents: list[NodeAgent],
) -> None:
    # p0 and p1 both have prefill work queued; the agent's node starts with far more.
    await cluster.report_load("p0", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50)
    load = NodeLoad("p-ld", "", queued_prefill_tokens=100_000, total_kv_blocks=100, free_kv_blocks=50)
    current = [load]
    samples = [0]

    def load_fn() -> NodeLoad:
        samples[0] += 1
        return current[0]

    # A heartbeat longer than the test: etcd hears the load at registration and on memory changes.
    settings = fast_settings(
        target_of(metadata_process), routing_targets=(cluster.target(0),), load_heartbeat_s=600
    )
    agent = NodeAgent(
        settings, make_node("p-ld", role=NodeRole.PREFILL, incarnation=""), load_fn, lambda _: None
    )
    agent.start()
    agents.append(agent)

    def stored(v: Any) -> NodeLoad | None:
        record = v.nodes.get("p-ld")
        return v.load(record.node) if record is not None else None

    def stored_queue(v: Any) -> int | None:
        load = stored(v)
        return load.queued_prefill_tokens if load is not None else None

    def stored_retained(v: Any) -> int | None:
        load = stored(v)
        return load.retained_bytes if load is not None else None

    async def reports_counted(n: int) -> None:
        async def counted() -> bool:
            return agent.stats().load_reports >= n

        # A report counts once its call returns, which may be after the view saw it.
        await eventually(counted, what=f"{n} load reports counted")
        assert agent.stats().load_reports == n

    await cluster.wait_views(lambda v: stored_queue(v) == 100_000, "the agent's node and its first load")
    async with cluster.client("acme") as client:
        assert await prefill_of(client, PROMPT) != "p-ld"
        # Its queue drains: only request counts changed, so only the stream says so.
        current[0] = dataclasses.replace(load, queued_prefill_tokens=0)

        async def to_agent_node() -> bool:
            return await prefill_of(client, PROMPT) == "p-ld"

        await eventually(to_agent_node, what="routing to follow the streamed load")
    assert [stored_queue(r.ctx.view) for r in cluster.replicas] == [100_000] * len(cluster.replicas)
    assert agent.stats().load_reports == 1
    # Its memory moves by a tenth of its blocks: that reaches etcd as well.
    current[0] = dataclasses.replace(load, queued_prefill_tokens=0, free_kv_blocks=40)
    await cluster.wait_views(lambda v: stored_queue(v) == 0, "the memory change in etcd")
    await reports_counted(2)
    # It starts retaining KV (the node's capacity is 1 GiB): that reaches etcd.
    current[0] = dataclasses.replace(current[0], retained_bytes=100 << 20)
    await cluster.wait_views(lambda v: stored_retained(v) == 100 << 20, "retained bytes in etcd")
    await reports_counted(3)
    # They grow by 30% of themselves, under 5% of the capacity: the eviction coordinator's
    # budgets are shares of the capacity, and etcd does not hear it.
    current[0] = dataclasses.replace(current[0], retained_bytes=130 << 20)
    seen = samples[0]

    async def sampled_twice() -> bool:
        # The reporter decides on a sample before it takes the next.
        return samples[0] >= seen + 2

    await eventually(sampled_twice, what="the agent to sample the small change")
    # The report it would have made was made, and counted, before that next sample.
    assert agent.stats().load_reports == 3
    # Then by more than 5% of the capacity: that reaches etcd, as the fourth report.
    current[0] = dataclasses.replace(current[0], retained_bytes=190 << 20)
    await cluster.wait_views(lambda v: stored_retained(v) == 190 << 20, "the larger move in etcd")
    await reports_counted(4)
    # Routing counts the open stream and its messages: load alone, no cache events.
    registry = cluster.replicas[0].ctx.telemetry.registry

    async def one_stream_open() -> bool:
        # One: a stream the agent is replacing (after an error) may be counted beside the new one.
        return registry.get_sample_value("kvplane_routing_node_streams") == 1

    await eventually(one_stream_open, what="routing to count the agent's one stream")
    assert (registry.get_sample_value(STREAM_MESSAGES, {"kind": "load"}) or 0) >= 1
    assert (registry.get_sample_value(STREAM_MESSAGES, {"kind": "cache"}) or 0) == 0


async def test_a_load_the_engine_says_changed_reaches_routing_on_the_stream_before_the_next_interval(
    cluster: RoutingCluster,
    metadata_process: ServiceProcess,
    agents: list[NodeAgent],
) -> None:
    await cluster.report_load("p0", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50)
    # A queue routing would take most of an hour to drain by its own reckoning.
    queued = 100_000_000
    load = NodeLoad("p-told", "", queued_prefill_tokens=queued, total_kv_blocks=100, free_kv_blocks=50)
    current = [load]
    # Sampled once an hour, and the stream's own interval a minute: only the engine's word makes
    # the agent sample again, and send it, within the test.
    settings = fast_settings(
        target_of(metadata_process),
        routing_targets=(cluster.target(0),),
        load_interval_s=3600,
        load_heartbeat_s=3600,
        prefix_cache_interval_s=60,
        prefix_cache_keepalive_s=60,
    )
    node = make_node("p-told", role=NodeRole.PREFILL, incarnation="")
    agent = NodeAgent(settings, node, lambda: current[0], lambda _: None)
    agent.start()
    agents.append(agent)

    def stored_queue(v: Any) -> int | None:
        record = v.nodes.get("p-told")
        stored = v.load(record.node) if record is not None else None
        return stored.queued_prefill_tokens if stored is not None else None

    await cluster.wait_views(lambda v: stored_queue(v) == queued, "the agent's node and its first load")
    async with cluster.client("acme") as client:
        assert await prefill_of(client, PROMPT) != "p-told"
        # Its queue drained, and the engine says so.
        current[0] = dataclasses.replace(load, queued_prefill_tokens=0)
        agent.notify_load()

        async def to_agent_node() -> bool:
            return await prefill_of(client, PROMPT) == "p-told"

        await eventually(to_agent_node, what="routing to follow the load the engine said changed")
    # etcd still holds the registration's load: only the interval's samples go there.
    assert [stored_queue(r.ctx.view) for r in cluster.replicas] == [queued] * len(cluster.replicas)
    assert agent.stats().load_reports == 1
