"""Load reports: `load_fn()` sampled every `load_interval_s`; each sample is handed to the node's
streams to routing (`prefix_cache.py`, which send it when it changed), and reported to etcd
(ReportLoad) at once after every registration, every `load_heartbeat_s`, and when it changed:

- while every routing replica the node streams to has a live stream, only a change of its
  memory counts (`memory_changed`, by shares of the node's KV capacity): routing has the request
  counts from the stream, and etcd's other reader, the eviction coordinator, needs the memory
  figures alone;
- otherwise (no routing targets, or a stream down) any material change (`load_changed`).

So a busy engine writes etcd at the pace of its memory, not of its requests (which was every
half second), and an idle one once a heartbeat. The node's liveness is its lease; the heartbeat
only shows that the agent's load path still runs (the `live` routing filter allows three
heartbeats). Runs on the agent's thread.

The engine may also say that its load just changed (`notify`, from any thread: the sim-engine
does when a request finishes): the agent then samples it at once, for the streams to routing,
instead of at the next interval, and the streams send it at once (etcd still hears only the
interval's samples). A conversation's
next turn is often sent the moment its answer ends; routing then sees the decode node without
that answer, not as busy as the last sample left it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.wake import ThreadWake
from kvplane.services.common.model import convert
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.v1 import metadata_pb2

log = logging.getLogger(__name__)


def load_changed(last: NodeLoad, now: NodeLoad) -> bool:
    """Whether `now` differs from the load last reported enough to report it before the
    heartbeat: any change of a request count, of queued prefill tokens, of the blocks waiting
    requests need, of retained bytes or of the block total, or free KV blocks moved by 1% of the
    total (at least one block)."""
    if (
        now.queued_requests != last.queued_requests
        or now.waiting_kv_blocks != last.waiting_kv_blocks
        or now.running_requests != last.running_requests
        or now.queued_prefill_tokens != last.queued_prefill_tokens
        or now.retained_bytes != last.retained_bytes
        or now.total_kv_blocks != last.total_kv_blocks
    ):
        return True
    return abs(now.free_kv_blocks - last.free_kv_blocks) >= max(1, now.total_kv_blocks // 100)


def memory_changed(last: NodeLoad, now: NodeLoad, capacity_bytes: int = 0) -> bool:
    """Whether `now`'s memory differs from the load last reported enough to report it before the
    heartbeat: the block total changed, free KV blocks moved by 5% of the total (at least one
    block), or retained bytes moved by 5% of the node's KV capacity (`capacity_bytes`; unknown,
    0: by a tenth of themselves, or to or from none).

    The eviction coordinator's budgets and watermarks are shares of the capacity, and it counts
    the published handles' bytes itself (the report matters where it holds more than they do):
    a move of retained bytes smaller than 5% of the capacity cannot move a node across them by
    more than that, the error free blocks are allowed, whether or not it starts or ends at none.
    Measured against themselves, retained bytes moved by a tenth on nearly every publish and
    release of a node that retains a few conversations; and going to and from none, they moved
    twice a turn on each engine of a conversation at a time (P's lease, D's handle). Each was an
    etcd write on the turn's path."""
    if now.total_kv_blocks != last.total_kv_blocks:
        return True
    if abs(now.free_kv_blocks - last.free_kv_blocks) >= max(1, now.total_kv_blocks // 20):
        return True
    moved = abs(now.retained_bytes - last.retained_bytes)
    if capacity_bytes > 0:
        return moved * 20 >= capacity_bytes
    if (now.retained_bytes == 0) != (last.retained_bytes == 0):
        return True
    return moved * 10 > max(now.retained_bytes, last.retained_bytes)


class LoadReporter:
    """Samples the engine's load, hands it to the streams to routing, and reports it to etcd."""

    def __init__(
        self,
        plane: ControlPlane,
        load_fn: Callable[[], NodeLoad],
        streamed: Callable[[], bool] = lambda: False,
    ) -> None:
        self._plane = plane
        # Called on the agent's thread: thread-safe, quick, never blocking.
        self._load_fn = load_fn
        # Whether every routing replica gets the load on a live stream now.
        self._streamed = streamed
        # The latest sample, stamped, for the streams (None until the first).
        self.latest: NodeLoad | None = None
        self.reports = 0
        self._wake = ThreadWake()
        # Set, on the agent's loop, when a sample differs from the one before (`load_changed`):
        # the streams to routing send it at once rather than at their next interval.
        self._listeners: list[asyncio.Event] = []

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The agent's loop started (or, with None, stopped)."""
        self._wake.attach(loop)

    def listen(self) -> asyncio.Event:
        """An event set whenever the latest sample changed (for one stream to routing, which
        clears it); on the agent's loop only."""
        event = asyncio.Event()
        self._listeners.append(event)
        return event

    def unlisten(self, event: asyncio.Event) -> None:
        """The stream that listened with `event` ended."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(event)

    def notify(self) -> None:
        """The engine's load changed: sample it now. Never blocks; any thread."""
        self._wake.set()

    async def run(self) -> None:
        plane = self._plane
        interval = plane.settings.load_interval_s
        last: NodeLoad | None = None  # the load last reported, for this registration
        last_sent = 0.0  # time.monotonic() of that report
        next_check = 0.0  # time.monotonic() of the next sample that may go to etcd
        registration = -1
        while not plane.is_stopping():
            await plane.session_ready.wait()
            if self._wake.event is not None:
                self._wake.event.clear()
            if registration != plane.registrations:
                # A new registration starts with no load stored: report at once.
                registration, last, next_check = plane.registrations, None, 0.0
            try:
                sampled = self._load_fn()
                load = dataclasses.replace(
                    sampled,
                    node_id=plane.node_id,
                    incarnation=plane.incarnation,
                    reported_unix_ms=int(time.time() * 1000),
                )
            except Exception:
                log.exception("load_fn failed; skipping this report")
                next_check = max(next_check, time.monotonic() + interval)
            else:
                # Every sample is the streams' to send; etcd hears the interval's samples only,
                # so an engine that says its load changed at every request's end writes etcd no
                # more often than before.
                previous, self.latest = self.latest, load
                if previous is None or load_changed(previous, load):
                    for event in self._listeners:
                        event.set()
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + interval
                    heartbeat = now - last_sent >= plane.settings.load_heartbeat_s
                    if last is None or heartbeat:
                        due = True
                    elif self._streamed():
                        due = memory_changed(last, load, plane.node_template.kv_capacity_bytes)
                    else:
                        due = load_changed(last, load)
                    if due and await self._report(load):
                        last, last_sent = load, now
            await plane.sleep_or_stop(max(0.0, next_check - time.monotonic()), self._wake.event)

    async def _report(self, load: NodeLoad) -> bool:
        """One ReportLoad of the stamped sample; False when it failed."""
        plane = self._plane
        try:
            await plane.meta.ReportLoad(
                metadata_pb2.ReportLoadRequest(load=convert.load_to_pb(load)),
                timeout=plane.settings.rpc_timeout_s,
                metadata=plane.call_metadata,
            )
        except grpc.aio.AioRpcError as err:
            plane.note_error("ReportLoad", err)
            return False
        self.reports += 1
        return True
