"""A test's reader of an engine's KV events: a SUB socket for the live stream and a DEALER for
replays, with deadlines (never fixed sleeps)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from kvplane.services.common.model.kv_events import END_SEQ, DecodedBatch, decode_batch, seq_bytes, seq_of


@dataclass(frozen=True)
class Batch:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def decoded(self) -> DecodedBatch:
        return decode_batch(self.payload)


@contextlib.contextmanager
def ipc_dir() -> Iterator[str]:
    """A short directory for ipc:// socket files (their paths are limited to about 100 bytes)."""
    path = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class EventReader:
    """Subscribes to `endpoint` (every topic) and asks `replay_endpoint` for missed batches."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"") -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint

    def close(self) -> None:
        self.sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EventReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next(self, timeout_s: float = 10.0) -> Batch:
        """The next live batch; fails after `timeout_s`."""
        if not self.sub.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no KV event batch within {timeout_s} s")
        topic, seq, payload = self.sub.recv_multipart()
        return Batch(topic, seq_of(seq), payload)

    def pending(self, wait_s: float = 0.0) -> list[Batch]:
        """Every live batch already received (waiting up to `wait_s` for the first)."""
        out: list[Batch] = []
        while self.sub.poll(int(wait_s * 1000) if not out else 0):
            topic, seq, payload = self.sub.recv_multipart()
            out.append(Batch(topic, seq_of(seq), payload))
        return out

    def warm(self, probe: Callable[[], object], next_seq: Callable[[], int], timeout_s: float = 20.0) -> int:
        """Call `probe` (something that publishes a batch) until a batch arrives, then read every
        probe up to the last: a SUB socket misses what is published before its subscription
        reaches the publisher. `next_seq`: the number the publisher gives its next batch.
        Returns that number once warm."""
        deadline = time.monotonic() + timeout_s
        while not self.sub.poll(100):  # a poll with a deadline, not a sleep
            if time.monotonic() > deadline:
                raise AssertionError(f"the subscription did not reach the publisher in {timeout_s} s")
            probe()
        got = self.next()
        last = next_seq() - 1
        if got.seq < last:
            self.drain_until(lambda b: b.seq >= last)
        return last + 1

    def drain_until(self, predicate: Callable[[Batch], bool], timeout_s: float = 10.0) -> list[Batch]:
        """Live batches up to and including the first that satisfies `predicate`."""
        out: list[Batch] = []
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching KV event batch in {timeout_s} s; got {len(out)}")
            batch = self.next(left)
            out.append(batch)
            if predicate(batch):
                return out

    def replay(self, start: int, timeout_s: float = 10.0) -> list[Batch]:
        """Every buffered batch from `start` on, as the replay socket answers (up to END_SEQ)."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", seq_bytes(start)])
            out: list[Batch] = []
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    raise AssertionError(f"the replay did not end within {timeout_s} s")
                empty, topic, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert topic == b"" and payload == b""
                    return out
                out.append(Batch(topic, seq_of(seq), payload))
        finally:
            dealer.close(linger=0)
