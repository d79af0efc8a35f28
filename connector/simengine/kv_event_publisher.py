"""The sim-engine's KV-cache event publisher: vLLM's `ZmqEventPublisher`, on the same wire.

A PUB socket sends each batch as three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0 at each start) and the msgpack batch (`kv_events.encode_batch`, in the
configured encoding). A ROUTER replay socket answers `[identity, "", start_seq]` with every
buffered batch from `start_seq` on, `[identity, "", topic, seq, payload]`, then the end marker
`[identity, "", "", END_SEQ, ""]`; the buffer keeps the last `buffer_steps` batches.

Threads: `publish` is called by the engine's event loop and never blocks: it numbers the batch
and queues it. The publisher thread encodes, sends, buffers and answers replay requests; it
sleeps in a poll on the replay socket and a wake-up pipe, never spinning. A batch that finds the
queue full (`max_queue_size`) is dropped with its number spent, so a subscriber sees a gap that
no replay fills (unlike vLLM, whose `publish` blocks then), and is counted.

Fault hooks for tests (any thread): `pause` holds batches in the queue (the stream stalls, then
catches up on `resume`); `drop_next(n)` numbers, buffers and never sends the next `n` batches (a
gap the replay fills).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence

import zmq

from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.services.common.model.kv_events import END_SEQ, KVEvent, encode_batch, seq_bytes

log = logging.getLogger(__name__)


class KVEventPublisher:
    """One engine's KV event sockets and their thread; `start` binds, `close` ends."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        # Shared with the publisher thread, under _lock.
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, float, Sequence[KVEvent]]] = collections.deque()
        self._next_seq = 0
        self._paused = False
        self._to_drop = 0
        self._closing = False
        self.sent = 0
        self.dropped_on_purpose = 0
        self.dropped_queue_full = 0
        # Publisher thread only.
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None

    # -- life ---------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets (errors surface here) and start the thread."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(self.config.hwm)
            pub.linger = 0
            self._pub = pub
            pub.bind(self.config.endpoint)
            if self.config.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.linger = 0
                self._replay = replay
                replay.bind(self.config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            ctx.term()
            raise
        self._ctx = ctx
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Send what is queued (unless paused), then close the sockets. Blocks briefly."""
        with self._lock:
            self._closing = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:  # a late publish must not write to a closed (maybe reused) descriptor
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- the engine's side ----------------------------------------------------

    def publish(self, events: Sequence[KVEvent]) -> int:
        """Queue one batch; returns its sequence number. Any thread; never blocks."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self.config.max_queue_size:
                self.dropped_queue_full += 1
                log.warning("KV event queue full: batch %d dropped (a gap no replay fills)", seq)
                return seq
            self._queue.append((seq, time.time(), events))
        self._wake()
        return seq

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    # -- fault hooks -----------------------------------------------------------

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
        self._wake()

    def drop_next(self, batches: int) -> None:
        """The next `batches` batches are buffered for replay but never sent."""
        if batches < 0:
            raise ValueError("batches must be non-negative")
        with self._lock:
            self._to_drop += batches

    def state(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "next_seq": self._next_seq,
                "queued": len(self._queue),
                "paused": self._paused,
                "dropping": self._to_drop,
                "sent": self.sent,
                "dropped_on_purpose": self.dropped_on_purpose,
                "dropped_queue_full": self.dropped_queue_full,
            }

    # -- the publisher thread ------------------------------------------------------

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(BlockingIOError, OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                # Queued batches are buffered before a replay is answered: a replay covers
                # every batch published before it was asked for.
                closing = self._send_queued()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if closing:
                    return
        except Exception:
            log.exception("KV event publisher thread failed")
        finally:
            self._close_sockets()

    def _send_queued(self) -> bool:
        """Send every queued batch unless paused; True once closing and nothing more will go."""
        while True:
            with self._lock:
                if self._paused or not self._queue:
                    return self._closing
                seq, ts, events = self._queue.popleft()
                drop = self._to_drop > 0
                if drop:
                    self._to_drop -= 1
            payload = encode_batch(ts, events, self.config.encoding, data_parallel_rank=self._rank)
            self._buffer.append((seq, payload))
            if drop:
                with self._lock:
                    self.dropped_on_purpose += 1
                continue
            assert self._pub is not None
            try:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            except zmq.ZMQError:
                log.exception("sending KV event batch %d failed", seq)
                continue
            with self._lock:
                self.sent += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((identity, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
