"""The node agent's reader of its own engine's KV-cache events: SUB, gaps replayed, resets.

Runs on the node agent's thread and asyncio loop, never on the engine's loop: the engine only
publishes (vLLM's publisher thread, or the sim-engine's), and nothing here can hold it up. The
work per batch is a msgpack decode and a few dict operations per block (`block_set.py`).

Sequence numbers count from 0 at each engine start, one per batch. The subscriber expects the
next one; what it gets instead decides what it does:

- the expected batch: applied;
- a later one (a gap: the SUB socket dropped batches, at its high-water mark or before it was
  connected): the missing batches are asked from the engine's ROUTER replay socket with a fresh
  DEALER (so that an abandoned replay's late answers are never read as another's) and applied in
  order, then the batch that showed the gap. The replay answers with every batch it still
  buffers from the start asked for; reading stops at the gap's end, so the work is bounded by the
  gap, not by the engine's buffer. A replay that cannot fill the gap (its buffer moved on: the
  first batch it has is past the start; no replay socket; no answer within `replay_timeout_s`; a
  gap longer than `max_gap_batches`; more than `max_replays` replays within `replay_window_s`, a
  storm) resets the block set instead: what the engine holds is then unknown, and the blocks
  stored from then on whose parents went with the reset are kept but never trusted;
- an earlier one (the engine restarted: its numbers start again from 0): the block set resets,
  and the batches before this one of the new start are replayed as for a gap;
- `AllBlocksCleared`: the block set resets (`BlockSet.apply`).

A reset is always safe for routing: it believes the node holds less, and a prefix it believes
held is still proven at the pull (the digest check) or only costs a recompute.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.services.common.model.kv_events import EventFormatError, decode_batch, seq_bytes, seq_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SubscriberLimits:
    """How hard the subscriber tries to fill gaps, and what it never exceeds."""

    # Longest wait for a replay's answer, in seconds.
    replay_timeout_s: float = 1.0
    # Longest gap filled by replay, in batches (vLLM buffers the last 10,000).
    max_gap_batches: int = 10_000
    # Replays allowed within replay_window_s; beyond that a gap resets instead (a storm).
    max_replays: int = 8
    replay_window_s: float = 1.0
    # Batches the SUB socket queues before it drops (ZMQ's receive high-water mark).
    receive_hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.replay_window_s <= 0:
            raise ValueError("replay_timeout_s and replay_window_s must be positive")
        if self.max_gap_batches < 0 or self.max_replays < 0 or self.receive_hwm <= 0:
            raise ValueError("max_gap_batches and max_replays must be >= 0, receive_hwm positive")


@dataclass(slots=True)
class SubscriberStats:
    """The subscriber's counters (the node agent's stats show them)."""

    batches: int = 0
    events: int = 0
    # Events of a type the decoder does not know (skipped), and batches that did not decode.
    unknown_events: int = 0
    malformed_batches: int = 0
    # Gaps filled by replay, gaps that could not be (each a reset), and replays asked.
    gaps_filled: int = 0
    gaps_unfilled: int = 0
    replays: int = 0
    # Sequence numbers that went back (engine restarts).
    restarts: int = 0


class KVEventsSubscriber:
    """Keeps `blocks` current from the engine's events; `run` on the node agent's loop."""

    def __init__(
        self, source: KVEventsSource, blocks: BlockSet, limits: SubscriberLimits | None = None
    ) -> None:
        self.source = source
        self.blocks = blocks
        self.limits = limits or SubscriberLimits()
        self.stats = SubscriberStats()
        # The sequence number expected next (0: the engine's first batch).
        self._expected = 0
        self._replay_times: deque[float] = deque()
        self._ctx: zmq.asyncio.Context | None = None

    async def run(self) -> None:
        """Reads and applies batches until cancelled. Must run on the node agent's loop."""
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, self.limits.receive_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            sub.connect(self.source.endpoint)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    self.stats.malformed_batches += 1
                    continue
                try:
                    seq = seq_of(frames[1])
                except EventFormatError:
                    self.stats.malformed_batches += 1
                    continue
                await self.receive(seq, frames[2])
        finally:
            sub.close(linger=0)
            self._ctx = None
            ctx.term()

    async def receive(self, seq: int, payload: bytes) -> None:
        """One live batch: a gap before it is filled (or the set reset), then it is applied."""
        if seq < self._expected:
            # Numbers went back: the engine started again, with an empty cache.
            self.stats.restarts += 1
            self.blocks.reset()
            self._expected = 0
        if seq > self._expected:
            await self._fill(self._expected, seq)
        self._apply(payload)
        self._expected = seq + 1

    async def _fill(self, start: int, end: int) -> None:
        """Applies batches [start, end) from the replay socket, or resets the set."""
        batches = await self._replay(start, end) if self._may_replay(end - start) else None
        if batches is None:
            self.stats.gaps_unfilled += 1
            self.blocks.reset()
            return
        for payload in batches:
            self._apply(payload)
        self.stats.gaps_filled += 1

    def _may_replay(self, gap: int) -> bool:
        limits = self.limits
        if self.source.replay_endpoint is None or gap > limits.max_gap_batches:
            return False
        now = asyncio.get_running_loop().time()
        times = self._replay_times
        while times and now - times[0] > limits.replay_window_s:
            times.popleft()
        if len(times) >= limits.max_replays:
            return False
        times.append(now)
        return True

    async def _replay(self, start: int, end: int) -> list[bytes] | None:
        """The payloads of batches [start, end) in order, or None when the replay cannot give
        exactly those. Reads no further than `end`: the rest of the engine's buffer is left."""
        ctx, endpoint = self._ctx, self.source.replay_endpoint
        if ctx is None or endpoint is None:
            return None
        self.stats.replays += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.replay_timeout_s
        dealer = ctx.socket(zmq.DEALER)
        got: list[bytes] = []
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", seq_bytes(start)])
            while len(got) < end - start:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(left * 1000):
                    log.info("KV event replay from %d timed out", start)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    return None
                seq = seq_of(frames[2])
                if seq != start + len(got):
                    # The end marker before the gap's end, or the buffer no longer holds `start`.
                    return None
                got.append(frames[3])
            return got
        except EventFormatError:
            return None
        finally:
            dealer.close(linger=0)

    def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventFormatError as exc:
            # Its blocks are unknown now: as for a gap that cannot be filled.
            log.warning("KV event batch not understood, resetting the block set: %s", exc)
            self.stats.malformed_batches += 1
            self.blocks.reset()
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.unknown_events += batch.unknown
        self.blocks.apply(batch.events)
