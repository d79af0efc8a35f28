"""The bounded queue of publishes and release reports the engine fills and the agent sends.

`put` may be called from any thread and never blocks: when the queue is full the oldest item is
dropped and counted. The agent's thread takes batches from its head (`take_batch`) and puts an
unsent batch back (`put_back`). The queue's lock guards the items and the drop counter.

Release reports at the head may wait for a publish to ride with (`take_batch`'s `linger_s`): a
read's freed blocks are then recorded in the transaction that publishes the turn's next handle,
one request instead of two.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvplane.services.common.model.handles import CacheHandle

# ReportReleased takes at most this many ids per call (metadata.proto).
MAX_RELEASE_BATCH = 1024
# PublishHandles takes at most this many handles per call (metadata.proto).
MAX_PUBLISH_BATCH = 256


@dataclass(frozen=True, slots=True)
class Item:
    kind: Literal["publish", "release"]
    handle: CacheHandle | None = None
    remote_request_id: str = ""
    # W3C trace context (`traceparent`, `tracestate`) of the request that retained the handle.
    trace_context: tuple[tuple[str, str], ...] = ()
    # time.monotonic() of the first failed send; 0: none failed yet.
    failing_since: float = 0.0
    # A publish only: told, on the agent's thread, whether the control plane stored the handle
    # (False: a relocation it refused, or a publish dropped unsent).
    on_outcome: Callable[[bool], None] | None = None
    # A release only: it may wait for a publish to go with (blocks P read: nothing routes to
    # them any more).
    lingers: bool = False
    # time.monotonic() when it was queued.
    queued_at: float = dataclasses.field(default_factory=time.monotonic)


class Outbox:
    """Items waiting to be sent, oldest first, at most `queue_max`; batches of one kind."""

    def __init__(self, queue_max: int, batch_max: int) -> None:
        self._queue_max = queue_max
        self._batch_max = batch_max
        self._lock = threading.Lock()
        self._queue: collections.deque[Item] = collections.deque()
        self.dropped = 0
        # The agent's loop and the event that wakes its sender; None while no thread runs.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None

    def attach(self, loop: asyncio.AbstractEventLoop | None, wake: asyncio.Event | None) -> None:
        """The agent's loop started (or, with None, stopped): `put` wakes the sender from now on."""
        self._loop, self.wake = loop, wake

    def put(self, item: Item) -> None:
        """Any thread; never blocks."""
        with self._lock:
            if len(self._queue) >= self._queue_max:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(item)
        loop, wake = self._loop, self.wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(wake.set)

    def take_batch(self, linger_s: float = 0.0) -> list[Item]:
        """The head batch, removed from the queue: leading publishes; or leading release reports
        with the publishes queued right after them (sent together), each kind up to its limit.

        With `linger_s`, release reports that may wait (`Item.lingers`) with no publish behind
        them stay queued (an empty batch) until the oldest is `linger_s` old or they fill a batch
        (`linger_deadline`); one that may not wait takes those ahead of it along at once."""
        with self._lock:
            if not self._queue:
                return []
            releases = self._leading("release", 0, MAX_RELEASE_BATCH)
            publishes = self._leading("publish", releases, MAX_PUBLISH_BATCH)
            if (
                not publishes
                and self._waiting(releases)
                and time.monotonic() < self._queue[0].queued_at + linger_s
            ):
                return []
            return [self._queue.popleft() for _ in range(releases + publishes)]

    def linger_deadline(self, linger_s: float) -> float | None:
        """time.monotonic() at which the release reports at the head stop waiting for a publish;
        None when none wait."""
        with self._lock:
            releases = self._leading("release", 0, MAX_RELEASE_BATCH)
            if self._leading("publish", releases, MAX_PUBLISH_BATCH) or not self._waiting(releases):
                return None
            return self._queue[0].queued_at + linger_s

    def _leading(self, kind: str, start: int, limit: int) -> int:
        """How many items of `kind` follow position `start`, up to the batch limits; lock held."""
        limit = min(self._batch_max, limit)
        n = 0
        while start + n < len(self._queue) and n < limit and self._queue[start + n].kind == kind:
            n += 1
        return n

    def _waiting(self, releases: int) -> bool:
        """Whether the `releases` leading reports may wait for a publish: some, every one of them
        a read's, not a full batch; lock held."""
        full = releases >= min(self._batch_max, MAX_RELEASE_BATCH)
        return releases > 0 and not full and all(self._queue[i].lingers for i in range(releases))

    def put_back(self, batch: list[Item]) -> None:
        """Return an unsent batch to the head of the queue, keeping the bound."""
        with self._lock:
            self._queue.extendleft(reversed(batch))
            while len(self._queue) > self._queue_max:
                self._queue.popleft()
                self.dropped += 1

    def drop(self, count: int) -> None:
        """Items that cannot be sent (resending cannot help), counted as dropped."""
        with self._lock:
            self.dropped += count

    def items(self) -> list[Item]:
        """What is queued now, oldest first (a copy)."""
        with self._lock:
            return list(self._queue)

    def counts(self) -> tuple[int, int]:
        """(queued, dropped), read together."""
        with self._lock:
            return len(self._queue), self.dropped
