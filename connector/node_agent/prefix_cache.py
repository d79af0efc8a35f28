"""The engine's prefix cache, streamed to every routing replica (RoutingService.StreamPrefixCache).

One job per routing target (`NodeAgentSettings.routing_targets`), on the agent's thread. Each
keeps one client-streaming call open: a full snapshot of the forwarded blocks
(`kvplane.connector.kv_events.block_set`) when it (re)connects and whenever its cursor asks for
one (the block set reset, or the pending delta outgrew its bound); then the coalesced delta every
`prefix_cache_interval_s` when something changed, and an empty keep-alive every
`prefix_cache_keepalive_s` when nothing did, so that routing can tell a quiet node from a lost
stream (its staleness bound). A broken stream is opened again with backoff, and starts again with
a snapshot. No message carries more than `MESSAGE_IDS` block ids: a larger snapshot or delta is
split. See `kvplane.services.routing.prefix_cache_stream` for why this path, and the README for
what it costs at 1,000 engines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from kvplane.connector.kv_events.block_set import BlockSet, Cursor
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.node_agent.control_plane import CHANNEL_OPTIONS, Backoff, ControlPlane
from kvplane.v1 import routing_pb2, routing_pb2_grpc

log = logging.getLogger(__name__)

# Block ids in one message at most (8 bytes each: 256 KiB, far under gRPC's 4 MiB limit): a larger
# snapshot or delta goes in several.
MESSAGE_IDS = 32_768


class PrefixCacheStream:
    """Streams the block set to one routing replica."""

    def __init__(self, plane: ControlPlane, target: str, blocks: BlockSet, source: KVEventsSource) -> None:
        self._plane = plane
        self.target = target
        self._blocks = blocks
        self._source = source
        # Counters, read by stats() from any thread.
        self.messages = 0
        self.bytes = 0
        self.streams_opened = 0

    async def run(self) -> None:
        plane, s = self._plane, self._plane.settings
        backoff = Backoff(s.backoff_initial_s, s.backoff_max_s)
        while not plane.is_stopping():
            channel = plane.credentials.channel(self.target, options=CHANNEL_OPTIONS)
            stub = routing_pb2_grpc.RoutingServiceStub(channel)
            cursor = self._blocks.cursor()
            try:
                self.streams_opened += 1
                await stub.StreamPrefixCache(self._updates(cursor, backoff), metadata=plane.call_metadata)
            except grpc.aio.AioRpcError as err:
                plane.note_error(f"StreamPrefixCache to {self.target}", err)
            finally:
                self._blocks.close(cursor)
                await channel.close(grace=None)
            await plane.sleep_or_stop(backoff.next_delay())

    async def _updates(
        self, cursor: Cursor, backoff: Backoff
    ) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
        s = self._plane.settings
        loop = asyncio.get_running_loop()
        last_sent = float("-inf")
        sequence = 0
        while True:
            now = loop.time()
            if cursor.needs_snapshot:
                ids = self._blocks.snapshot_for(cursor)
                parts = _parts(ids, ())
                for i, (part, _) in enumerate(parts):
                    yield self._message(sequence, True, part, (), continues=i < len(parts) - 1)
                    sequence += 1
                last_sent = now
                backoff.reset()  # the stream carried a snapshot: it works
            elif cursor.added or cursor.removed or now - last_sent >= s.prefix_cache_keepalive_s:
                for stored, removed in _parts(*cursor.take()):
                    yield self._message(sequence, False, stored, removed)
                    sequence += 1
                last_sent = now
            await asyncio.sleep(s.prefix_cache_interval_s)

    def _message(
        self,
        sequence: int,
        snapshot: bool,
        stored: Sequence[int],
        removed: Sequence[int],
        continues: bool = False,
    ) -> routing_pb2.StreamPrefixCacheRequest:
        source = self._source
        message = routing_pb2.StreamPrefixCacheRequest(
            node_id=self._plane.node_id,
            incarnation=self._plane.incarnation,
            snapshot=snapshot,
            stored_block_ids=stored,
            removed_block_ids=removed,
            block_size=source.block_size,
            hash_algo=source.hash_algo,
            hash_seed=source.hash_seed,
            checkpoint_blocks=self._blocks.checkpoint_blocks,
            sequence=sequence,
            snapshot_continues=continues,
        )
        self.messages += 1
        self.bytes += message.ByteSize()
        return message


def _parts(stored: Sequence[int], removed: Sequence[int]) -> list[tuple[Sequence[int], Sequence[int]]]:
    """(stored, removed) in parts of at most MESSAGE_IDS ids, removals first; one empty part for
    nothing (a keep-alive, or an empty snapshot)."""
    parts: list[tuple[Sequence[int], Sequence[int]]] = [
        ((), removed[i : i + MESSAGE_IDS]) for i in range(0, len(removed), MESSAGE_IDS)
    ]
    parts += [(stored[i : i + MESSAGE_IDS], ()) for i in range(0, len(stored), MESSAGE_IDS)]
    return parts or [((), ())]
