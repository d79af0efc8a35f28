"""StreamPrefixCache's receiving end: a node's prefix-cache messages into the replica's view, and
its load into the replica's streamed loads (`state.streamed_loads` says why loads travel here).

How the node agents' block sets reach routing, and why this way: every node agent streams its own
engine's forwarded block ids (`kvplane.connector.kv_events.block_set`) to every routing replica
it is configured with (`NodeAgentSettings.routing_targets`) on one client-streaming call each: a
full snapshot on every (re)connect (a replica that restarts, or a new one, learns a node's whole
cache within one round trip of its reconnect), then coalesced deltas at most every 100 ms, and a
keep-alive at least every 2 s when nothing changed, so that a view older than the staleness
bound (`routing.prefix_cache_stale_after_s`, 6 s) is known to be stale and the router falls back
to its own record. Nothing goes through etcd: a block's life (stored, evicted within seconds) is
far too short and too frequent for a consensus store, and routing needs it only as a hint with a
staleness bound. Replicas are stateless peers, so each receives every node's stream; with R
replicas and N engines that is N x R long-lived streams, each carrying 8 bytes per block change
(packed fixed64) plus a small header per message. Measured figures and the estimate at 1,000
engines are in docs/benchmarks.md (bench/prefix_cache_events_bench.py).

Authorisation: node principals only, and each only for its own node id (as for every node call);
the first message names the node, and every later message must name the same node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvplane.services.common.model import convert, validation
from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.routing.state.engine_caches import CacheUpdate, EngineCaches, HashConfig
from kvplane.services.routing.state.streamed_loads import StreamedLoads
from kvplane.v1 import routing_pb2

# Block ids one message may carry (a snapshot is split into parts of at most this many).
MAX_BLOCK_IDS_PER_MESSAGE = 1 << 20
MAX_HASH_ALGO = 32
MAX_HASH_SEED = 256
MAX_BLOCK_SIZE = 1 << 16


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """One message of a node's stream: its cache update (None: a node that streams its load
    alone) and its load (None: unchanged since the stream's last)."""

    node_id: str
    incarnation: str
    cache: CacheUpdate | None
    load: NodeLoad | None


def message_from_pb(message: routing_pb2.StreamPrefixCacheRequest) -> StreamMessage:
    """The message as domain values; raises InvalidArgument for an invalid one."""
    node_id = validation.ident(message.node_id, "node_id")
    incarnation = validation.ident(message.incarnation, "incarnation")
    load = None
    if message.HasField("load"):
        load = convert.checked_load_from_pb(message.load)
        if load.node_id != node_id or load.incarnation != incarnation:
            raise InvalidArgument("load", "must name the stream's node and incarnation")
    ids = len(message.stored_block_ids) + len(message.removed_block_ids)
    if message.block_size == 0:
        # A node without KV-cache events: its load and keep-alives only.
        if ids or message.snapshot or message.snapshot_continues:
            raise InvalidArgument("block_size", "must be set in a message that carries blocks")
        return StreamMessage(node_id, incarnation, None, load)
    return StreamMessage(node_id, incarnation, _cache_update(message, node_id, incarnation, ids), load)


def _cache_update(
    message: routing_pb2.StreamPrefixCacheRequest, node_id: str, incarnation: str, ids: int
) -> CacheUpdate:
    """The message's cache update; raises InvalidArgument for an invalid one."""
    if ids > MAX_BLOCK_IDS_PER_MESSAGE:
        limit = MAX_BLOCK_IDS_PER_MESSAGE
        raise InvalidArgument("stored_block_ids", f"and removed_block_ids hold more than {limit} ids")
    validation.in_range(message.block_size, "block_size", 1, MAX_BLOCK_SIZE)
    validation.in_range(message.checkpoint_blocks, "checkpoint_blocks", 1, MAX_BLOCK_SIZE)
    config = HashConfig(
        message.block_size,
        validation.text(message.hash_algo, "hash_algo", max_bytes=MAX_HASH_ALGO),
        validation.text(message.hash_seed, "hash_seed", max_bytes=MAX_HASH_SEED),
        message.checkpoint_blocks,
    )
    return CacheUpdate(
        node_id,
        incarnation,
        config,
        message.snapshot,
        message.stored_block_ids,
        message.removed_block_ids,
        message.snapshot_continues,
    )


async def receive(
    principal: Principal,
    messages: AsyncIterator[routing_pb2.StreamPrefixCacheRequest],
    caches: EngineCaches,
    loads: StreamedLoads,
    now_s: Callable[[], float],
    on_message: Callable[[bool], None] = lambda carries_cache: None,
    *,
    apply_caches: bool = True,
) -> int:
    """Applies a node's stream to `caches` and `loads` until it ends; returns the messages applied.
    `on_message` hears of each valid message: whether it carried cache events (or load alone).
    `apply_caches` False: the loads only (`routing.engine_cache_events` off); messages are still
    validated, and a cache message counts as applied."""
    principal.require(PrincipalKind.NODE)
    node_id = ""
    applied = 0
    async for pb in messages:
        message = message_from_pb(pb)
        if not node_id:
            node_id = principal.as_node(message.node_id, "node_id")
        elif message.node_id != node_id:
            raise InvalidArgument("node_id", "must be the same in every message of a stream")
        now = now_s()
        on_message(message.cache is not None)
        loads.heard(node_id, message.incarnation, message.load, now)
        if message.cache is None or not apply_caches or caches.apply(message.cache, now):
            applied += 1
    return applied
