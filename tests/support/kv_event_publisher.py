"""A test engine's KV-event publisher: vLLM's wire (PUB topic/seq/payload, ROUTER replay), with
the faults tests need: batches buffered but not sent (a gap), a buffer that forgot them (a gap
replay cannot fill), sequence numbers starting again (a restart).

It uses an XPUB socket so that a test can wait for the subscriber's subscription before it
publishes, instead of losing the first batches to ZMQ's slow joiner."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    Encoding,
    KVEvent,
    encode_batch,
    seq_bytes,
)
from kvplane.services.common.runtime.ports import free_port


def local_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class EventPublisher:
    """Publishes KV event batches as an engine does; `serve` answers replays on the test's loop."""

    def __init__(self, topic: str = "kv", buffer_steps: int = 10_000, encoding: Encoding = "map") -> None:
        self.endpoint = local_endpoint()
        self.replay_endpoint = local_endpoint()
        self.topic = topic
        self.encoding: Encoding = encoding
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.replays = 0
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.bind(self.endpoint)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind(self.replay_endpoint)
        self._server: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EventPublisher:
        self._server = asyncio.create_task(self._serve_replays())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._server
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Waits for a subscriber's subscription (XPUB's subscribe message)."""
        while True:
            frame = await asyncio.wait_for(self._pub.recv(), timeout_s)
            if frame[:1] == b"\x01":
                return

    async def publish(self, events: Sequence[KVEvent], *, send: bool = True) -> int:
        """One batch under the next sequence number, buffered for replay; `send=False`: lost on
        the way (the subscriber sees a gap). Returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(float(seq), events, self.encoding)
        self.buffer.append((seq, payload))
        if send:
            await self._pub.send_multipart([self.topic.encode(), seq_bytes(seq), payload])
        return seq

    async def send_late(self, seq: int) -> None:
        """Sends a buffered batch on the PUB socket now (after batches buffered since)."""
        payload = next(p for s, p in self.buffer if s == seq)
        await self._pub.send_multipart([self.topic.encode(), seq_bytes(seq), payload])

    def restart(self) -> None:
        """The engine starts again: numbers from 0, an empty replay buffer."""
        self.next_seq = 0
        self.buffer.clear()

    def forget_buffer(self) -> None:
        """The replay buffer moved on: nothing before the next batch can be replayed."""
        self.buffer.clear()

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            topic = self.topic.encode()
            for seq, payload in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart([client, b"", topic, seq_bytes(seq), payload])
            await self._router.send_multipart([client, b"", b"", END_SEQ, b""])


def stored_chain(
    hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str | None = None, medium: str = "GPU"
) -> BlockStored:
    """The BlockStored an engine publishes for a prompt's whole blocks (its first event of it)."""
    ids = hasher.ids(token_ids, cache_salt)
    size = hasher.block_size
    return BlockStored(
        block_ids=tuple(ids),
        parent_id=None,
        token_ids=tuple(token_ids[: len(ids) * size]),
        block_size=size,
        medium=medium,
        extra_keys=(cache_salt,) if cache_salt else None,
    )


def stored(ids: Sequence[int], parent: int | None, block_size: int = 16, medium: str = "GPU") -> BlockStored:
    """Blocks with made-up ids, after `parent`."""
    return BlockStored(tuple(ids), parent, tuple(range(len(ids) * block_size)), block_size, medium)


def removed(ids: Sequence[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(ids), medium)
