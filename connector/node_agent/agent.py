"""`NodeAgent`: the engine-facing API and the agent's thread, which runs the agent's jobs.

The engine calls `publish`, `report_released`, `notify_demand`, `pending` and `stats` from any
thread; none of them waits for the network. Everything else runs on the agent's own thread and
asyncio loop: registration (`registration.py`), load reports (`load.py`), the outbox's sender
(`sending.py`), the eviction command stream (`commands.py`, with `demand.py`) and, given the
engine's KV-cache event source, its subscriber (`kvplane.connector.kv_events.subscriber`) and the
prefix-cache streams to routing (`prefix_cache.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.kv_events.subscriber import KVEventsSubscriber
from kvplane.connector.node_agent.commands import AckedFrees, CommandStream
from kvplane.connector.node_agent.control_plane import CHANNEL_OPTIONS, ControlPlane
from kvplane.connector.node_agent.demand import DemandReporter
from kvplane.connector.node_agent.load import LoadReporter
from kvplane.connector.node_agent.outbox import Item, Outbox
from kvplane.connector.node_agent.prefix_cache import PrefixCacheStream
from kvplane.connector.node_agent.registration import Registration
from kvplane.connector.node_agent.sending import Sender
from kvplane.connector.node_agent.settings import AgentStats, NodeAgentError, NodeAgentSettings
from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.v1 import metadata_pb2

log = logging.getLogger(__name__)

# The W3C trace-context headers a publish carries as gRPC metadata.
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})


class NodeAgent:
    """Registers one engine, reports its handles and load, applies release commands.

    Callbacks (`load_fn`, `on_release`, `on_drain`, `demand_fn`, `retained_fn`, `on_spill_order`,
    `on_move`) run on the agent's thread: they must be thread-safe, quick and must not block.
    """

    def __init__(
        self,
        settings: NodeAgentSettings,
        node: Node,
        load_fn: Callable[[], NodeLoad],
        on_release: Callable[[str], None],
        on_drain: Callable[[], None] | None = None,
        demand_fn: Callable[[], int] | None = None,
        retained_fn: Callable[[], Iterable[str]] | None = None,
        kv_events: KVEventsSource | None = None,
        on_spill_order: Callable[[Sequence[str], Sequence[str]], None] | None = None,
        on_move: Callable[[str], str] | None = None,
    ) -> None:
        self._settings = settings
        self._node_template = node
        self._plane = ControlPlane(settings, node)
        self._outbox = Outbox(settings.queue_max, settings.batch_max)
        self._registration = Registration(self._plane, self._outbox, on_release, retained_fn)
        # The streams to routing replicas: the load always, the prefix cache when the engine's
        # KV-cache events are read (None: not read). While every stream is live, etcd gets only the
        # load's memory changes (`load.py`).
        self._prefix_streams: list[PrefixCacheStream] = []
        self._load = LoadReporter(self._plane, load_fn, streamed=self._all_streams_live)
        self._sender = Sender(self._plane, self._outbox, on_release)
        self._demand = DemandReporter(self._plane, demand_fn) if demand_fn is not None else None
        self._acked_frees = AckedFrees(settings.seen_commands_max)
        self._commands = CommandStream(
            self._plane, on_release, on_drain, self._demand, self._acked_frees, on_spill_order, on_move
        )
        self._blocks: BlockSet | None = None
        self._subscriber: KVEventsSubscriber | None = None
        if kv_events is not None:
            self._blocks = BlockSet(
                max_blocks=settings.prefix_cache_max_blocks,
                checkpoint_blocks=settings.prefix_cache_checkpoint_blocks,
            )
            self._subscriber = KVEventsSubscriber(kv_events, self._blocks)
        self._prefix_streams = [
            PrefixCacheStream(self._plane, target, self._load, self._blocks, kv_events)
            for target in settings.routing_targets
        ]
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()

    def _all_streams_live(self) -> bool:
        streams = self._prefix_streams
        return bool(streams) and all(stream.live for stream in streams)

    # ------------------------------------------------------------------ engine-facing API

    @property
    def incarnation(self) -> str:
        """The incarnation of the current start; empty before the first start()."""
        return self._plane.incarnation

    @property
    def node(self) -> Node:
        """The node as registered: the template with this start's incarnation."""
        return dataclasses.replace(self._node_template, incarnation=self._plane.incarnation)

    def start(self) -> None:
        """Start the agent thread with a new incarnation. Returns without waiting for the network.

        Called by the engine (any thread), once per start; raises NodeAgentError if running."""
        if self._thread is not None and self._thread.is_alive():
            raise NodeAgentError("node agent already started")
        self._plane.incarnation = uuid.uuid4().hex
        self._plane.registered = False
        self._started.clear()
        self._thread = threading.Thread(
            target=self._thread_main, name=f"kvplane-agent-{self._node_template.node_id}", daemon=True
        )
        self._thread.start()
        self._started.wait(timeout=5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush what can be flushed quickly, deregister, and join the thread (engine's thread)."""
        thread, loop, stopping = self._thread, self._loop, self._stopping
        if thread is None:
            return
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            log.warning("node agent thread did not stop within %.1f s", timeout_s)
        self._thread = None

    def publish(
        self,
        handle: CacheHandle,
        trace_context: Mapping[str, str] | None = None,
        on_outcome: Callable[[bool], None] | None = None,
    ) -> None:
        """Queue a retained handle for PublishHandles. Never blocks; any thread.

        The agent stamps the holder node id and incarnation itself. `trace_context` (the
        `traceparent` of the turn that retained the handle) makes the publish part of that trace.
        `on_outcome(stored)` is called on the agent's thread once the control plane has answered
        (False: a relocation it refused) or the publish was dropped unsent (False); a publish
        given up as stale frees its request instead (`on_release`). It must be quick and
        thread-safe.
        """
        context = tuple((k, v) for k, v in (trace_context or {}).items() if k in _TRACE_KEYS)
        self._outbox.put(Item("publish", handle=handle, trace_context=context, on_outcome=on_outcome))

    def report_released(self, remote_request_id: str, *, after_read: bool = False) -> None:
        """Queue a "blocks freed" report for ReportReleased. Never blocks; any thread.

        `after_read`: P read the blocks (their handle was checked out, so nothing routes to them
        any more): the report may wait for a publish to go with (`release_linger_s`). Any other
        free (an expiry, the engine's own) is sent at once, so that no turn is routed to a handle
        whose blocks are gone. Blocks freed by a release command whose ack records the free are
        not reported again."""
        if self._acked_frees.take(remote_request_id):
            return
        self._outbox.put(Item("release", remote_request_id=remote_request_id, lingers=after_read))

    def notify_demand(self) -> None:
        """The engine's KV demand changed: send `demand_fn()` now. Never blocks; any thread."""
        if self._demand is not None:
            self._demand.notify()

    def set_accepts_moves(self, accepts: bool) -> None:
        """The engine takes the leader's moves to its host tier from now on, or not (its host tier
        switched on or off): the command stream says so in a new hello. Never blocks; any thread."""
        loop = self._loop
        if loop is None:
            self._commands.set_accepts_moves(accepts)  # not running: the first hello says it
        else:
            loop.call_soon_threadsafe(self._commands.set_accepts_moves, accepts)

    def notify_load(self) -> None:
        """The engine's load just changed (a request finished): sample `load_fn()` now rather
        than at the next `load_interval_s`. Never blocks; any thread."""
        self._load.notify()

    def pending(self) -> tuple[list[CacheHandle], list[str]]:
        """Queued, not yet sent: handles to publish and request ids to report released. Any thread."""
        items = self._outbox.items()
        handles = [i.handle for i in items if i.kind == "publish" and i.handle is not None]
        return handles, [i.remote_request_id for i in items if i.kind == "release"]

    def stats(self) -> AgentStats:
        """The counters, for tests and the engine's logs. Any thread."""
        queued, dropped = self._outbox.counts()
        plane, commands = self._plane, self._commands
        return AgentStats(
            registered=plane.registered,
            registrations=plane.registrations,
            published=self._sender.published,
            released_reported=self._sender.released_reported,
            dropped=dropped,
            queued=queued,
            load_reports=self._load.reports,
            commands_applied=commands.applied,
            commands_duplicate=commands.duplicates,
            demand_reports=self._demand.reports if self._demand is not None else 0,
            command_streams_opened=commands.opened,
            rpc_errors=plane.rpc_errors,
            reconciled_freed=self._registration.reconciled_freed,
            publishes_given_up=self._sender.publishes_given_up,
            relocations_refused=self._sender.relocations_refused,
            publishes_refused_freed=self._sender.publishes_refused_freed,
            spill_orders=commands.spill_orders,
            **self._kv_event_stats(),
        )

    @property
    def reads_kv_events(self) -> bool:
        """Whether the engine's KV-cache events are read (`held_prefix` knows anything)."""
        return self._blocks is not None

    def held_prefix(self, block_ids: Sequence[int], medium: str) -> int:
        """How many of a chain's leading blocks the engine holds on `medium`, as its KV events
        tell (0 when they are not read). Any thread: the set may be a moment old."""
        blocks = self._blocks
        return 0 if blocks is None else blocks.held_prefix(block_ids, medium)

    def _kv_event_stats(self) -> dict[str, int]:
        sub, blocks = self._subscriber, self._blocks
        if sub is None or blocks is None:
            return {}
        return {
            "kv_event_batches": sub.stats.batches,
            "kv_events": sub.stats.events,
            "kv_unknown_events": sub.stats.unknown_events,
            "kv_gaps_filled": sub.stats.gaps_filled,
            "kv_resets": blocks.stats.resets,
            "kv_restarts": sub.stats.restarts,
            "kv_blocks": len(blocks),
            "prefix_cache_messages": sum(p.messages for p in self._prefix_streams),
        }

    # ------------------------------------------------------------------ the thread

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except Exception:  # the agent must never take the engine down
            log.exception("node agent stopped on an unexpected error")
        finally:
            self._loop = None
            self._outbox.attach(None, None)
            if self._demand is not None:
                self._demand.attach(None)
            self._load.attach(None)
            self._plane.registered = False
            loop.close()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outbox.attach(self._loop, asyncio.Event())
        if self._demand is not None:
            self._demand.attach(self._loop)
        self._load.attach(self._loop)
        self._stopping = asyncio.Event()
        self._started.set()
        s = self._settings
        credentials = self._plane.credentials
        meta_channel = credentials.channel(s.metadata_target, options=CHANNEL_OPTIONS)
        evict_channel = (
            credentials.channel(s.eviction_target, options=CHANNEL_OPTIONS)
            if s.eviction_target and s.eviction_target != s.metadata_target
            else meta_channel
        )
        self._plane.open(meta_channel, evict_channel, self._stopping)
        tasks = [
            asyncio.create_task(self._registration.run(), name="kvplane-agent-session"),
            asyncio.create_task(self._load.run(), name="kvplane-agent-load"),
            asyncio.create_task(self._sender.run(), name="kvplane-agent-queue"),
            asyncio.create_task(self._commands.run(), name="kvplane-agent-commands"),
        ]
        if self._subscriber is not None:
            tasks.append(asyncio.create_task(self._subscriber.run(), name="kvplane-agent-kv-events"))
        tasks += [
            asyncio.create_task(stream.run(), name=f"kvplane-agent-prefix-cache-{stream.target}")
            for stream in self._prefix_streams
        ]
        try:
            await self._stopping.wait()
        finally:
            for task in tasks:
                task.cancel()
            # A call cancelled mid-flight may surface as an RpcError the loops retry; they also
            # check the stop flag, so a bounded wait is enough.
            await asyncio.wait(tasks, timeout=1.0)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(s.stop_flush_s):
                    await self._shutdown_flush()
            await meta_channel.close(grace=None)
            if evict_channel is not meta_channel:
                await evict_channel.close(grace=None)

    async def _shutdown_flush(self) -> None:
        plane = self._plane
        if not plane.session_ready.is_set():
            return
        while await self._sender.send_one_batch():
            pass
        if self._settings.deregister_on_stop:
            await plane.meta.DeregisterNode(
                metadata_pb2.DeregisterNodeRequest(node_id=plane.node_id, incarnation=plane.incarnation),
                timeout=self._settings.rpc_timeout_s,
                metadata=plane.call_metadata,
            )
