"""The engine's prefix cache and load, streamed to every routing replica
(RoutingService.StreamPrefixCache).

One job per routing target (`NodeAgentSettings.routing_targets`), on the agent's thread. Each
keeps one client-streaming call open: a full snapshot of the forwarded blocks
(`kvplane.connector.kv_events.block_set`) when it (re)connects and whenever its cursor asks for
one (the block set reset, or the pending delta outgrew its bound); then the coalesced delta every
`prefix_cache_interval_s` when something changed, and an empty keep-alive every
`prefix_cache_keepalive_s` when nothing did, so that routing can tell a quiet node from a lost
stream (its staleness bound). The node's load (`load.py`'s latest sample) rides on the first
message and on any message after it changed (`load_changed`), and a changed sample is sent at once,
not at the next interval (the engine's word that a request ended reaches routing in
milliseconds); a node without KV-cache events
streams its load and keep-alives alone (block size 0). A broken stream is opened again with
backoff, and starts again with a snapshot and the load. No message carries more than
`MESSAGE_IDS` block ids: a larger snapshot or delta is split. See
`kvplane.services.routing.prefix_cache_stream` and `kvplane.services.routing.state.streamed_loads`
for why this path, and docs/benchmarks.md for what it costs at 1,000 engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from kvplane.connector.kv_events.block_set import BlockSet, Cursor
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.node_agent.control_plane import CHANNEL_OPTIONS, Backoff, ControlPlane
from kvplane.connector.node_agent.load import LoadReporter, load_changed
from kvplane.services.common.model import convert
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.v1 import routing_pb2, routing_pb2_grpc

log = logging.getLogger(__name__)

# Block ids in one message at most (8 bytes each: 256 KiB, far under gRPC's 4 MiB limit): a larger
# snapshot or delta goes in several.
MESSAGE_IDS = 32_768


class PrefixCacheStream:
    """Streams the block set (when the engine's KV events are read) and the load to one routing
    replica."""

    def __init__(
        self,
        plane: ControlPlane,
        target: str,
        loads: LoadReporter,
        blocks: BlockSet | None = None,
        source: KVEventsSource | None = None,
    ) -> None:
        if (blocks is None) != (source is None):
            raise ValueError("blocks and source go together")
        self._plane = plane
        self.target = target
        self._loads = loads
        self._blocks = blocks
        self._source = source
        # The load last sent on the current stream (None: none yet).
        self._sent_load: NodeLoad | None = None
        # Whether the current stream has carried a message since it opened (read by the load
        # reporter: while every stream is live, etcd gets only memory changes).
        self.live = False
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
            cursor = self._blocks.cursor() if self._blocks is not None else None
            self._sent_load = None
            try:
                self.streams_opened += 1
                await stub.StreamPrefixCache(self._updates(cursor, backoff), metadata=plane.call_metadata)
            except grpc.aio.AioRpcError as err:
                plane.note_error(f"StreamPrefixCache to {self.target}", err)
            finally:
                self.live = False
                if self._blocks is not None and cursor is not None:
                    self._blocks.close(cursor)
                await channel.close(grace=None)
            await plane.sleep_or_stop(backoff.next_delay())

    async def _updates(
        self, cursor: Cursor | None, backoff: Backoff
    ) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
        load_changed_event = self._loads.listen()
        try:
            async for message in self._messages(cursor, backoff, load_changed_event):
                yield message
        finally:
            self._loads.unlisten(load_changed_event)

    async def _messages(
        self, cursor: Cursor | None, backoff: Backoff, load_changed_event: asyncio.Event
    ) -> AsyncIterator[routing_pb2.StreamPrefixCacheRequest]:
        s = self._plane.settings
        loop = asyncio.get_running_loop()
        last_sent = float("-inf")
        sequence = 0
        while True:
            now = loop.time()
            if sequence:
                # gRPC took this stream's first message: it is open.
                self.live = True
            if cursor is None:
                load = self._load_to_send()
                if load is not None or now - last_sent >= s.prefix_cache_keepalive_s:
                    yield self._message(sequence, False, (), (), load=load)
                    sequence += 1
                    last_sent = now
                    backoff.reset()
            elif cursor.needs_snapshot:
                assert self._blocks is not None  # a cursor is only had from a block set
                ids = self._blocks.snapshot_for(cursor)
                parts = _parts(ids, ())
                for i, (part, _) in enumerate(parts):
                    load = self._load_to_send() if i == 0 else None
                    yield self._message(sequence, True, part, (), continues=i < len(parts) - 1, load=load)
                    sequence += 1
                last_sent = now
                backoff.reset()  # the stream carried a snapshot: it works
            else:
                load = self._load_to_send()
                if (
                    load is not None
                    or cursor.added
                    or cursor.removed
                    or now - last_sent >= s.prefix_cache_keepalive_s
                ):
                    for i, (stored, removed) in enumerate(_parts(*cursor.take())):
                        yield self._message(sequence, False, stored, removed, load=load if i == 0 else None)
                        sequence += 1
                    last_sent = now
            # A load the engine says changed goes at once: a conversation's next turn is often
            # routed a few milliseconds after its answer ends, and should find D without it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(s.prefix_cache_interval_s):
                    await load_changed_event.wait()
            load_changed_event.clear()

    def _load_to_send(self) -> NodeLoad | None:
        """The latest load sample when this stream has not carried it yet and it changed since the
        one it carried (or the stream has carried none)."""
        latest = self._loads.latest
        if latest is None or latest.incarnation != self._plane.incarnation:
            return None
        sent = self._sent_load
        if sent is not None and (sent is latest or not load_changed(sent, latest)):
            return None
        self._sent_load = latest
        return latest

    def _message(
        self,
        sequence: int,
        snapshot: bool,
        stored: Sequence[int],
        removed: Sequence[int],
        continues: bool = False,
        load: NodeLoad | None = None,
    ) -> routing_pb2.StreamPrefixCacheRequest:
        message = routing_pb2.StreamPrefixCacheRequest(
            node_id=self._plane.node_id,
            incarnation=self._plane.incarnation,
            snapshot=snapshot,
            stored_block_ids=stored,
            removed_block_ids=removed,
            sequence=sequence,
            snapshot_continues=continues,
        )
        source, blocks = self._source, self._blocks
        if source is not None and blocks is not None:
            message.block_size = source.block_size
            message.hash_algo = source.hash_algo
            message.hash_seed = source.hash_seed
            message.checkpoint_blocks = blocks.checkpoint_blocks
        if load is not None:
            message.load.CopyFrom(convert.load_to_pb(load))
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
