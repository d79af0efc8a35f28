"""The bounded queue of publishes and release reports the engine fills and the agent sends.

`put` may be called from any thread and never blocks: when the queue is full the oldest item is
dropped and counted. The agent's thread takes batches from its head (`take_batch`) and puts an
unsent batch back (`put_back`). The queue's lock guards the items and the drop counter.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
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

    def take_batch(self) -> list[Item]:
        """Leading items of one kind, up to the batch limit, removed from the queue."""
        with self._lock:
            if not self._queue:
                return []
            kind = self._queue[0].kind
            limit = min(self._batch_max, MAX_PUBLISH_BATCH if kind == "publish" else MAX_RELEASE_BATCH)
            batch: list[Item] = []
            while self._queue and self._queue[0].kind == kind and len(batch) < limit:
                batch.append(self._queue.popleft())
            return batch

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
