"""StreamPrefixCache's messages at the service boundary: validated, turned into domain values, and
applied only for the caller's own node."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kvplane.services.common.model.errors import InvalidArgument, PermissionDenied
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.routing import prefix_cache_stream
from kvplane.services.routing.state.engine_caches import EngineCaches
from kvplane.v1 import routing_pb2


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
    update = prefix_cache_stream.update_from_pb(message(removed_block_ids=[3], snapshot_continues=True))
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
    ],
)
def test_invalid_messages_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        prefix_cache_stream.update_from_pb(message(**bad))


async def stream(
    *messages: routing_pb2.StreamPrefixCacheRequest,
) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
    for m in messages:
        yield m


async def test_a_node_reports_for_itself_only_and_one_node_per_stream() -> None:
    caches = EngineCaches()
    p0 = Principal(PrincipalKind.NODE, "p0")
    assert (
        await prefix_cache_stream.receive(p0, stream(message(), message(snapshot=False)), caches, lambda: 0.0)
        == 2
    )
    with pytest.raises(PermissionDenied):
        await prefix_cache_stream.receive(p0, stream(message(node_id="p1")), caches, lambda: 0.0)
    with pytest.raises(InvalidArgument):
        await prefix_cache_stream.receive(p0, stream(message(), message(node_id="p1")), caches, lambda: 0.0)
    with pytest.raises(PermissionDenied):
        operator = Principal(PrincipalKind.OPERATOR, "gw")
        await prefix_cache_stream.receive(operator, stream(message()), caches, lambda: 0.0)
    assert caches.blocks("p1") == 0 and caches.blocks("p0") == 2
