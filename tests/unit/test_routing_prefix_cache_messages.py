"""StreamPrefixCache's messages at the service boundary: validated, turned into domain values, and
applied only for the caller's own node."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from kvplane.services.common.model.errors import InvalidArgument, PermissionDenied
from kvplane.services.common.model.nodes import Node, NodeLoad, NodeRole
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.routing import prefix_cache_stream
from kvplane.services.routing.state.engine_caches import EngineCaches
from kvplane.services.routing.state.streamed_loads import StreamedLoads
from kvplane.v1 import node_pb2, routing_pb2
from tests.support.routing_cluster import node

LOADS = StreamedLoads(2.0, 8)


def message(**kw: object) -> routing_pb2.StreamPrefixCacheRequest:
    values: dict[str, object] = dict(
        node_id="p0",
        incarnation="i1",
        snapshot=True,
        stored_block_ids=[1, 2],
        block_size=16,
        hash_algo="sha256",
        hash_seed="vllm-none-hash",
        checkpoint_blocks=1,
    )
    values.update(kw)
    return routing_pb2.StreamPrefixCacheRequest(**values)  # type: ignore[arg-type]


def test_a_message_becomes_a_cache_update() -> None:
    parsed = prefix_cache_stream.message_from_pb(message(removed_block_ids=[3], snapshot_continues=True))
    update = parsed.cache
    assert update is not None and parsed.load is None, "a message without a load leaves the load as it was"
    assert (update.node_id, update.incarnation, update.snapshot) == ("p0", "i1", True)
    assert list(update.stored) == [1, 2] and list(update.removed) == [3] and update.snapshot_continues
    assert (update.config.block_size, update.config.algo, update.config.checkpoint_blocks) == (
        16,
        "sha256",
        1,
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"node_id": ""},
        {"incarnation": ""},
        {"block_size": 0},
        {"checkpoint_blocks": 0},
        {"hash_algo": ""},
        {"hash_algo": "x" * 100},
        # A message without a block size carries no blocks: a snapshot of none is no snapshot.
        {"block_size": 0, "stored_block_ids": [], "snapshot": True},
        # A load must be the stream's node's, and its counts in range.
        {"load": node_pb2.NodeLoad(node_id="p1", incarnation="i1")},
        {"load": node_pb2.NodeLoad(node_id="p0", incarnation="i0")},
        {"load": node_pb2.NodeLoad(node_id="p0", incarnation="i1", retained_bytes=1 << 62)},
    ],
)
def test_invalid_messages_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        prefix_cache_stream.message_from_pb(message(**bad))


async def stream(
    *messages: routing_pb2.StreamPrefixCacheRequest,
) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
    for m in messages:
        yield m


async def test_a_node_reports_for_itself_only_and_one_node_per_stream() -> None:
    caches = EngineCaches()
    p0 = Principal(PrincipalKind.NODE, "p0")
    assert (
        await prefix_cache_stream.receive(
            p0, stream(message(), message(snapshot=False)), caches, StreamedLoads(2.0, 8), lambda: 0.0
        )
        == 2
    )
    with pytest.raises(PermissionDenied):
        await prefix_cache_stream.receive(p0, stream(message(node_id="p1")), caches, LOADS, lambda: 0.0)
    with pytest.raises(InvalidArgument):
        await prefix_cache_stream.receive(
            p0, stream(message(), message(node_id="p1")), caches, LOADS, lambda: 0.0
        )
    with pytest.raises(PermissionDenied):
        operator = Principal(PrincipalKind.OPERATOR, "gw")
        await prefix_cache_stream.receive(operator, stream(message()), caches, LOADS, lambda: 0.0)
    assert caches.blocks("p1") == 0 and caches.blocks("p0") == 2


def _node() -> Node:
    return dataclasses.replace(node("p0", NodeRole.PREFILL), incarnation="i1")


def _load(**kw: int) -> node_pb2.NodeLoad:
    return node_pb2.NodeLoad(node_id="p0", incarnation="i1", **kw)


async def test_a_node_without_kv_events_streams_its_load_alone() -> None:
    caches, loads = EngineCaches(), StreamedLoads(2.0, 8)
    p0 = Principal(PrincipalKind.NODE, "p0")
    load_only = message(block_size=0, stored_block_ids=[], snapshot=False, load=_load(running_requests=3))
    keep_alive = message(block_size=0, stored_block_ids=[], snapshot=False)
    assert (
        await prefix_cache_stream.receive(p0, stream(load_only, keep_alive), caches, loads, lambda: 5.0) == 2
    )
    assert caches.blocks("p0") == 0, "no cache view from a node that sends no blocks"
    seen = loads.load(_node(), None, 6.0)
    assert seen is not None and seen.running_requests == 3


async def test_a_load_rides_on_a_cache_message_too() -> None:
    caches, loads = EngineCaches(), StreamedLoads(2.0, 8)
    p0 = Principal(PrincipalKind.NODE, "p0")
    await prefix_cache_stream.receive(
        p0, stream(message(load=_load(queued_requests=4))), caches, loads, lambda: 1.0
    )
    assert caches.blocks("p0") == 2
    assert loads.load(_node(), NodeLoad("p0", "i1"), 1.5) == NodeLoad("p0", "i1", queued_requests=4)
