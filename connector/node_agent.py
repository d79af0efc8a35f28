"""The node agent: an engine's link to the control plane, on its own thread.

Engine-agnostic: the vLLM connector uses it, and so does the engine simulator. The API is
small and stable:

    agent = NodeAgent(settings, node, load_fn, on_release, on_drain=None, demand_fn=None,
                      retained_fn=None)
    agent.start()                        # own thread, own asyncio loop; returns at once
    agent.incarnation                    # new uuid at every start()
    agent.publish(handle)                # never blocks: enqueue a retained handle
    agent.report_released(request_id)    # never blocks: enqueue "blocks freed"
    agent.notify_demand()                # never blocks: demand_fn() changed, send it now
    agent.stats()                        # counters, for tests and the engine's logs
    agent.pending()                      # what is queued and not yet sent
    agent.stop(timeout_s=5.0)            # flush briefly, deregister, join the thread

What the agent does, all on its own thread:

- registers the node (MetadataService.RegisterNode) under the incarnation, keeps the lease
  alive (KeepAlive: a failed refresh is retried within half a second, not a whole interval
  later) and registers again when the lease is gone (NOT_FOUND);
- after every registration, reconciles: asks the control plane which of the handles the engine
  retains (`retained_fn()`) nothing references any more (their records were purged while the
  node was away) and frees those through `on_release`;
- samples `load_fn()` every `load_interval_s` and reports it (ReportLoad) when it changed
  materially since the last report (a request count, queued prefill tokens, retained bytes, or
  free KV blocks by 1% of the total), at once after every registration, and otherwise every
  `load_heartbeat_s` (10 s): an idle engine writes its load to etcd a tenth of a second, not
  twice a second. The node's liveness is its lease; the heartbeat only shows that the agent's
  load path still runs (the `live` routing filter allows three heartbeats);
- sends publishes (PublishHandles) and releases (ReportReleased) from one bounded queue, in
  order, batching consecutive items of one kind. A publish that keeps failing is retried (the
  node registers again when the control plane no longer knows it; metadata takes a new lease
  when one is gone) until `publish_give_up_s` after its first failure, or until the handle's
  wall-clock expiry: then it is given up with a warning naming the handle, and its blocks are
  freed through `on_release` (nothing would ever reference them), so that one handle never
  holds up the queue behind it for good;
- keeps the EvictionService.Commands stream open: says hello, applies each ReleaseCommand by
  calling `on_release(remote_request_id)` (DrainCommand: `on_drain()`), at most once per
  command id, and acknowledges every command;
- sends the engine's KV demand (`demand_fn()`: blocks its waiting requests need beyond its free
  blocks and the blocks it is already freeing) on the same stream: at once when the engine calls
  `notify_demand()`, after every (re)connect, and again every `demand_refresh_s` while it lasts.
  Acks and demand share one ordered stream, so a demand report sent after an ack already counts
  the release acknowledged;
- retries everything with exponential backoff and full jitter.

Callbacks (`load_fn`, `on_release`, `on_drain`, `demand_fn`) run on the agent's thread: they must be
thread-safe, quick and must not block. `publish` and `report_released` may be called from any
thread. When the control plane is unreachable the engine keeps serving: nothing the engine
calls ever waits for the network, and when the queue is full the oldest item is dropped and
counted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from kvplane.services.client.credentials import CallMetadata, ClientCredentials
from kvplane.services.common import convert
from kvplane.services.common.handles import CacheHandle
from kvplane.services.common.nodes import Node, NodeLoad
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc, metadata_pb2, metadata_pb2_grpc

log = logging.getLogger(__name__)

# Status codes after which a call is worth repeating, later.
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)
# Status codes that mean the credentials were refused.
_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Status codes that mean "this node or incarnation is not (or no longer) registered".
_NOT_REGISTERED = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})
# ReportReleased takes at most this many ids per call (metadata.proto).
_MAX_RELEASE_BATCH = 1024
# The W3C trace-context headers a publish carries as gRPC metadata.
_TRACE_KEYS = frozenset({"traceparent", "tracestate"})
# PublishHandles takes at most this many handles per call (metadata.proto).
_MAX_PUBLISH_BATCH = 256
# ReconcileRetained takes at most this many ids per call (metadata.proto).
_MAX_RECONCILE_BATCH = 1024
# The longest wait before a failed KeepAlive is sent again, in seconds: the lease keeps running.
_KEEPALIVE_RETRY_MAX_S = 0.5
# Channels to the control plane reconnect within a second of a restarted service being back,
# not after gRPC's default backoff (up to two minutes).
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class NodeAgentError(Exception):
    """Misuse of the node agent (for example starting it twice)."""


@dataclass(frozen=True, slots=True)
class NodeAgentSettings:
    """How the agent reaches the control plane and how hard it tries."""

    # host:port of the metadata service.
    metadata_target: str
    # host:port of the eviction service; empty: the metadata target (`kvplane serve all`).
    eviction_target: str = ""
    # Lease time-to-live requested at registration, in seconds (2 to 300). Long enough to outlive
    # a control-plane restart: a dead engine is avoided at once anyway (suspect marks).
    lease_ttl_s: int = 30
    # Seconds between samples of the engine's load: a change is reported this soon, and load
    # reports are never closer together than this.
    load_interval_s: float = 0.5
    # Longest gap between two load reports while the load does not change, in seconds.
    load_heartbeat_s: float = 10.0
    # Most items one PublishHandles or ReportReleased call carries.
    batch_max: int = 64
    # Items the queue holds; beyond that the oldest is dropped and counted.
    queue_max: int = 4096
    # Deadline of one unary call, in seconds.
    rpc_timeout_s: float = 2.0
    # First and largest retry delay, in seconds (exponential, full jitter).
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    # Command ids remembered for at-most-once application.
    seen_commands_max: int = 8192
    # On stop(): seconds spent flushing the queue and deregistering.
    stop_flush_s: float = 1.0
    # Seconds between repeats of a KV demand that lasts (a lost or ignored report is re-sent).
    demand_refresh_s: float = 0.5
    # Whether stop() deregisters the node (its handles are then purged at once).
    deregister_on_stop: bool = True
    # Seconds a publish may keep failing before it is given up and its blocks freed.
    publish_give_up_s: float = 30.0
    # Bearer token for the control plane (shorthand for credentials.token).
    auth_token: str = dataclasses.field(default="", repr=False)
    # Token, TLS and mesh secret presented to the control plane (kvplane.services.client.credentials).
    credentials: ClientCredentials = dataclasses.field(default_factory=ClientCredentials)

    def __post_init__(self) -> None:
        if not self.metadata_target:
            raise ValueError("metadata_target is required")
        if not 2 <= self.lease_ttl_s <= 300:
            raise ValueError("lease_ttl_s must be within 2..300")
        if self.batch_max < 1 or self.queue_max < 1 or self.seen_commands_max < 1:
            raise ValueError("batch_max, queue_max and seen_commands_max must be positive")
        if self.load_interval_s <= 0 or self.rpc_timeout_s <= 0 or self.demand_refresh_s <= 0:
            raise ValueError("load_interval_s, rpc_timeout_s and demand_refresh_s must be positive")
        if self.load_heartbeat_s < self.load_interval_s:
            raise ValueError("load_heartbeat_s must be at least load_interval_s")
        if self.publish_give_up_s <= 0:
            raise ValueError("publish_give_up_s must be positive")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


@dataclass(frozen=True, slots=True)
class AgentStats:
    """A snapshot of the agent's counters."""

    registered: bool
    registrations: int
    published: int
    released_reported: int
    dropped: int
    queued: int
    load_reports: int
    commands_applied: int
    commands_duplicate: int
    demand_reports: int
    command_streams_opened: int
    rpc_errors: int
    # Retained handles freed because nothing referenced them at a (re)registration.
    reconciled_freed: int = 0
    # Publishes given up (failing past publish_give_up_s, or expired), their blocks freed.
    publishes_given_up: int = 0


@dataclass(frozen=True, slots=True)
class _Item:
    kind: Literal["publish", "release"]
    handle: CacheHandle | None = None
    remote_request_id: str = ""
    # W3C trace context (`traceparent`, `tracestate`) of the request that retained the handle.
    trace_context: tuple[tuple[str, str], ...] = ()
    # time.monotonic() of the first failed send; 0: none failed yet.
    failing_since: float = 0.0


def load_changed(last: NodeLoad, now: NodeLoad) -> bool:
    """Whether `now` differs from the load last reported enough to report it before the
    heartbeat: any change of a request count, of queued prefill tokens, of retained bytes or
    of the block total, or free KV blocks moved by 1% of the total (at least one block)."""
    if (
        now.queued_requests != last.queued_requests
        or now.running_requests != last.running_requests
        or now.queued_prefill_tokens != last.queued_prefill_tokens
        or now.retained_bytes != last.retained_bytes
        or now.total_kv_blocks != last.total_kv_blocks
    ):
        return True
    return abs(now.free_kv_blocks - last.free_kv_blocks) >= max(1, now.total_kv_blocks // 100)


class _Backoff:
    """Exponential backoff with full jitter."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial = initial_s
        self._max = max_s
        self._attempt = 0

    def reset(self) -> None:
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self._max, self._initial * (2**self._attempt))
        self._attempt = min(self._attempt + 1, 32)
        return random.uniform(0.0, ceiling)


class NodeAgent:
    """Registers one engine, reports its handles and load, applies release commands."""

    def __init__(
        self,
        settings: NodeAgentSettings,
        node: Node,
        load_fn: Callable[[], NodeLoad],
        on_release: Callable[[str], None],
        on_drain: Callable[[], None] | None = None,
        demand_fn: Callable[[], int] | None = None,
        retained_fn: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self._settings = settings
        # The request ids of the handles the engine retains; None: no reconciliation.
        self._retained_fn = retained_fn
        self._reconciled_freed = 0
        self._publishes_given_up = 0
        self._background: set[asyncio.Task[None]] = set()
        self._demand_fn = demand_fn
        self._demand_wake: asyncio.Event | None = None
        self._node_template = node
        self._load_fn = load_fn
        self._on_release = on_release
        self._on_drain = on_drain
        self._incarnation = ""
        self._lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        # Sent with every call. The control plane takes the node's identity from the credentials
        # (token or certificate); the headers name it only for a mesh proxy to vouch for.
        self._credentials = settings.credentials.merged(token=settings.auth_token)
        self._metadata = CallMetadata(
            self._credentials, (("x-kvplane-role", "node"), ("x-kvplane-node", node.node_id))
        )
        self._last_refusal = ""
        self._seen: collections.OrderedDict[str, bool] = collections.OrderedDict()
        # Counters; written on the agent thread (and under _lock for the queue ones).
        self._registered = False
        self._registrations = 0
        self._published = 0
        self._released_reported = 0
        self._dropped = 0
        self._load_reports = 0
        self._commands_applied = 0
        self._commands_duplicate = 0
        self._demand_reports = 0
        self._streams_opened = 0
        self._rpc_errors = 0

    # ------------------------------------------------------------------ engine-facing API

    @property
    def _call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with every call; a rotated token file is read again (CallMetadata)."""
        return self._metadata.current()

    @property
    def incarnation(self) -> str:
        """The incarnation of the current start; empty before the first start()."""
        return self._incarnation

    @property
    def node(self) -> Node:
        """The node as registered: the template with this start's incarnation."""
        return dataclasses.replace(self._node_template, incarnation=self._incarnation)

    def start(self) -> None:
        """Start the agent thread with a new incarnation. Returns without waiting for the network."""
        if self._thread is not None and self._thread.is_alive():
            raise NodeAgentError("node agent already started")
        self._incarnation = uuid.uuid4().hex
        self._registered = False
        self._started.clear()
        self._thread = threading.Thread(
            target=self._thread_main, name=f"kvplane-agent-{self._node_template.node_id}", daemon=True
        )
        self._thread.start()
        self._started.wait(timeout=5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush what can be flushed quickly, deregister, and join the thread."""
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

    def publish(self, handle: CacheHandle, trace_context: Mapping[str, str] | None = None) -> None:
        """Queue a retained handle for PublishHandles. Never blocks.

        The agent stamps the holder node id and incarnation itself. `trace_context` (the
        `traceparent` of the turn that retained the handle) makes the publish part of that trace.
        """
        context = tuple((k, v) for k, v in (trace_context or {}).items() if k in _TRACE_KEYS)
        self._enqueue(_Item("publish", handle=handle, trace_context=context))

    def report_released(self, remote_request_id: str) -> None:
        """Queue a "blocks freed" report for ReportReleased. Never blocks."""
        self._enqueue(_Item("release", remote_request_id=remote_request_id))

    def notify_demand(self) -> None:
        """The engine's KV demand changed: send `demand_fn()` now. Never blocks; any thread."""
        loop, wake = self._loop, self._demand_wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(wake.set)

    def pending(self) -> tuple[list[CacheHandle], list[str]]:
        """Queued, not yet sent: handles to publish and request ids to report released."""
        with self._lock:
            items = list(self._queue)
        handles = [i.handle for i in items if i.kind == "publish" and i.handle is not None]
        return handles, [i.remote_request_id for i in items if i.kind == "release"]

    def stats(self) -> AgentStats:
        with self._lock:
            queued, dropped = len(self._queue), self._dropped
        return AgentStats(
            registered=self._registered,
            registrations=self._registrations,
            published=self._published,
            released_reported=self._released_reported,
            dropped=dropped,
            queued=queued,
            load_reports=self._load_reports,
            commands_applied=self._commands_applied,
            commands_duplicate=self._commands_duplicate,
            demand_reports=self._demand_reports,
            command_streams_opened=self._streams_opened,
            rpc_errors=self._rpc_errors,
            reconciled_freed=self._reconciled_freed,
            publishes_given_up=self._publishes_given_up,
        )

    # ------------------------------------------------------------------ queue

    def _enqueue(self, item: _Item) -> None:
        with self._lock:
            if len(self._queue) >= self._settings.queue_max:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(item)
        self._poke()

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(wake.set)

    def _take_batch(self) -> list[_Item]:
        """Leading items of one kind, up to the batch limit, removed from the queue."""
        with self._lock:
            if not self._queue:
                return []
            kind = self._queue[0].kind
            limit = min(
                self._settings.batch_max,
                _MAX_PUBLISH_BATCH if kind == "publish" else _MAX_RELEASE_BATCH,
            )
            batch: list[_Item] = []
            while self._queue and self._queue[0].kind == kind and len(batch) < limit:
                batch.append(self._queue.popleft())
            return batch

    def _put_back(self, batch: list[_Item]) -> None:
        """Return an unsent batch to the head of the queue, keeping the bound."""
        with self._lock:
            self._queue.extendleft(reversed(batch))
            while len(self._queue) > self._settings.queue_max:
                self._queue.popleft()
                self._dropped += 1

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
            self._registered = False
            loop.close()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._demand_wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._session_ready = asyncio.Event()
        self._reregister = asyncio.Event()
        self._lease_id = 0
        # Held while a publish batch is in flight, and while reconciling: a handle being
        # published is never taken for an unreferenced one.
        self._send_lock = asyncio.Lock()
        self._started.set()
        s = self._settings
        meta_channel = self._credentials.channel(s.metadata_target, options=_CHANNEL_OPTIONS)
        evict_channel = (
            self._credentials.channel(s.eviction_target, options=_CHANNEL_OPTIONS)
            if s.eviction_target and s.eviction_target != s.metadata_target
            else meta_channel
        )
        self._meta = metadata_pb2_grpc.MetadataServiceStub(meta_channel)
        self._evict = eviction_pb2_grpc.EvictionServiceStub(evict_channel)
        tasks = [
            asyncio.create_task(self._session_loop(), name="kvplane-agent-session"),
            asyncio.create_task(self._load_loop(), name="kvplane-agent-load"),
            asyncio.create_task(self._queue_loop(), name="kvplane-agent-queue"),
            asyncio.create_task(self._commands_loop(), name="kvplane-agent-commands"),
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
                await asyncio.wait_for(self._shutdown_flush(), timeout=s.stop_flush_s)
            await meta_channel.close(grace=None)
            if evict_channel is not meta_channel:
                await evict_channel.close(grace=None)

    async def _shutdown_flush(self) -> None:
        if not self._session_ready.is_set():
            return
        while await self._send_one_batch():
            pass
        if self._settings.deregister_on_stop:
            await self._meta.DeregisterNode(
                metadata_pb2.DeregisterNodeRequest(
                    node_id=self._node_template.node_id, incarnation=self._incarnation
                ),
                timeout=self._settings.rpc_timeout_s,
                metadata=self._call_metadata,
            )

    def _note_error(self, what: str, err: grpc.aio.AioRpcError) -> None:
        self._rpc_errors += 1
        if err.code() in _REFUSED:
            # Misconfigured credentials leave the engine unregistered: say so where operators look,
            # once per distinct refusal rather than at every retry.
            refusal = f"{err.code().name}: {err.details()}"
            if refusal != self._last_refusal:
                self._last_refusal = refusal
                log.warning(
                    "the control plane refused %s for node %s (%s); presenting %s",
                    what,
                    self._node_template.node_id,
                    refusal,
                    self._credentials.describe(),
                )
        else:
            log.debug("%s failed: %s %s", what, err.code(), err.details())
        if err.code() in _NOT_REGISTERED:
            self._mark_unregistered()

    def _mark_unregistered(self) -> None:
        self._registered = False
        self._session_ready.clear()
        self._reregister.set()

    def _is_stopping(self) -> bool:
        return self._stopping is not None and self._stopping.is_set()

    async def _sleep_or_stop(self, delay_s: float) -> None:
        stopping = self._stopping
        assert stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=delay_s)

    # ------------------------------------------------------------------ registration, lease

    async def _register(self) -> None:
        node = dataclasses.replace(
            self._node_template, incarnation=self._incarnation, registered_unix_ms=int(time.time() * 1000)
        )
        resp = await self._meta.RegisterNode(
            metadata_pb2.RegisterNodeRequest(
                node=convert.node_to_pb(node), lease_ttl_s=self._settings.lease_ttl_s
            ),
            timeout=self._settings.rpc_timeout_s,
            metadata=self._call_metadata,
        )
        self._lease_id = resp.lease_id
        self._granted_ttl_s = resp.lease_ttl_s or self._settings.lease_ttl_s
        self._registrations += 1
        self._registered = True
        self._reregister.clear()
        self._session_ready.set()
        log.info(
            "registered node %s incarnation %s (lease %x, ttl %d s)",
            node.node_id,
            self._incarnation,
            self._lease_id,
            self._granted_ttl_s,
        )

    async def _session_loop(self) -> None:
        backoff = _Backoff(self._settings.backoff_initial_s, self._settings.backoff_max_s)
        retry_now = False
        while not self._is_stopping():
            if not self._session_ready.is_set():
                try:
                    await self._register()
                    backoff.reset()
                except grpc.aio.AioRpcError as err:
                    self._note_error("RegisterNode", err)
                    await self._sleep_or_stop(backoff.next_delay())
                    continue
                retry_now = False
                self._spawn(self._reconcile(), "kvplane-agent-reconcile")
            if not retry_now:
                # Refresh at a third of the lease so two lost refreshes are survivable.
                interval = max(0.2, self._granted_ttl_s / 3.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reregister.wait(), timeout=interval)
            retry_now = False
            if not self._session_ready.is_set():
                continue
            try:
                await self._meta.KeepAlive(
                    metadata_pb2.KeepAliveRequest(
                        node_id=self._node_template.node_id,
                        incarnation=self._incarnation,
                        lease_id=self._lease_id,
                    ),
                    timeout=self._settings.rpc_timeout_s,
                    metadata=self._call_metadata,
                )
                backoff.reset()
            except grpc.aio.AioRpcError as err:
                self._note_error("KeepAlive", err)
                if err.code() not in _NOT_REGISTERED:
                    # The lease runs on while the control plane restarts: try again promptly.
                    await self._sleep_or_stop(min(backoff.next_delay(), _KEEPALIVE_RETRY_MAX_S))
                    retry_now = True

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reconcile(self) -> None:
        """Frees the retained handles nothing in the control plane references.

        Under the send lock, so no publish is in flight: every id the engine
        held when asked was either published (and is referenced unless it was
        released, purged or consumed), still queued (kept), or dropped (freed).
        """
        if self._retained_fn is None:
            return
        incarnation = self._incarnation
        try:
            async with self._send_lock:
                held = list(dict.fromkeys(self._retained_fn()))
                unreferenced: list[str] = []
                for start in range(0, len(held), _MAX_RECONCILE_BATCH):
                    resp = await self._meta.ReconcileRetained(
                        metadata_pb2.ReconcileRetainedRequest(
                            node_id=self._node_template.node_id,
                            incarnation=incarnation,
                            remote_request_ids=held[start : start + _MAX_RECONCILE_BATCH],
                        ),
                        timeout=self._settings.rpc_timeout_s,
                        metadata=self._call_metadata,
                    )
                    unreferenced += resp.unreferenced_request_ids
                with self._lock:
                    queued = {
                        item.handle.vllm.remote_request_id
                        for item in self._queue
                        if item.kind == "publish" and item.handle is not None
                    }
        except grpc.aio.AioRpcError as err:
            # The next registration reconciles again; until then the engine's TTL bounds the loss.
            self._note_error("ReconcileRetained", err)
            return
        for request_id in unreferenced:
            if request_id in queued:
                continue
            try:
                self._on_release(request_id)
            except Exception:
                log.exception("freeing unreferenced request %s failed", request_id)
                continue
            self._reconciled_freed += 1
        if unreferenced:
            log.warning(
                "node %s freed %d retained handle(s) nothing referenced any more",
                self._node_template.node_id,
                len(unreferenced),
            )

    # ------------------------------------------------------------------ load

    async def _load_loop(self) -> None:
        last: NodeLoad | None = None  # the load last reported, for this registration
        last_sent = 0.0  # time.monotonic() of that report
        registration = -1
        while not self._is_stopping():
            await self._session_ready.wait()
            if registration != self._registrations:
                # A new registration starts with no load stored: report at once.
                registration, last = self._registrations, None
            try:
                load = dataclasses.replace(
                    self._load_fn(), node_id=self._node_template.node_id, incarnation=self._incarnation
                )
            except Exception:
                log.exception("load_fn failed; skipping this report")
            else:
                now = time.monotonic()
                if (
                    last is None
                    or load_changed(last, load)
                    or now - last_sent >= self._settings.load_heartbeat_s
                ):
                    stamped = dataclasses.replace(load, reported_unix_ms=int(time.time() * 1000))
                    try:
                        await self._meta.ReportLoad(
                            metadata_pb2.ReportLoadRequest(load=convert.load_to_pb(stamped)),
                            timeout=self._settings.rpc_timeout_s,
                            metadata=self._call_metadata,
                        )
                        self._load_reports += 1
                        last, last_sent = load, now
                    except grpc.aio.AioRpcError as err:
                        self._note_error("ReportLoad", err)
            await self._sleep_or_stop(self._settings.load_interval_s)

    # ------------------------------------------------------------------ publishes and releases

    async def _queue_loop(self) -> None:
        assert self._wake is not None
        backoff = _Backoff(self._settings.backoff_initial_s, self._settings.backoff_max_s)
        while not self._is_stopping():
            self._wake.clear()
            await self._session_ready.wait()
            try:
                sent = await self._send_one_batch()
            except grpc.aio.AioRpcError as err:
                self._note_error("publish/release", err)
                await self._sleep_or_stop(backoff.next_delay())
                continue
            backoff.reset()
            if not sent:
                await self._wake.wait()

    async def _send_one_batch(self) -> bool:
        """Send the head batch. False when the queue was empty. Puts the batch back on errors."""
        async with self._send_lock:
            return await self._send_head_batch()

    async def _send_head_batch(self) -> bool:
        batch = self._take_batch()
        if not batch:
            return False
        if batch[0].kind == "publish":
            batch = self._give_up_stale(batch)
            if not batch:
                return True
        try:
            if batch[0].kind == "publish":
                await self._publish_batch(batch)
            else:
                await self._release_batch(batch)
        except grpc.aio.AioRpcError as err:
            if err.code() in _RETRYABLE or err.code() in _NOT_REGISTERED:
                now = time.monotonic()
                self._put_back([dataclasses.replace(i, failing_since=i.failing_since or now) for i in batch])
            else:
                # INVALID_ARGUMENT and the like: resending cannot help.
                with self._lock:
                    self._dropped += len(batch)
                log.warning(
                    "dropping %d %s item(s): %s %s", len(batch), batch[0].kind, err.code(), err.details()
                )
            raise
        return True

    def _give_up_stale(self, batch: list[_Item]) -> list[_Item]:
        """The publishes still worth sending; the others are given up and their blocks freed.

        A handle past its wall-clock expiry is never handed out, and one whose publish kept
        failing for `publish_give_up_s` (re-registrations and new leases included) would
        otherwise be retried for good, holding up every item queued behind it.
        """
        now, now_ms = time.monotonic(), int(time.time() * 1000)
        keep: list[_Item] = []
        for item in batch:
            handle = item.handle
            assert handle is not None
            if handle.wall_expiry_unix_ms <= now_ms:
                why = "it expired before it could be published"
            elif item.failing_since and now - item.failing_since >= self._settings.publish_give_up_s:
                why = f"publishing it kept failing for {now - item.failing_since:.1f} s"
            else:
                keep.append(item)
                continue
            log.warning(
                "node %s gives up handle %s (tenant %s, conversation %s, request %s): %s; "
                "its blocks are freed",
                self._node_template.node_id,
                handle.handle_id or "(no id)",
                handle.tenant,
                handle.conversation,
                handle.vllm.remote_request_id,
                why,
            )
            self._publishes_given_up += 1
            try:
                self._on_release(handle.vllm.remote_request_id)
            except Exception:
                log.exception("freeing request %s failed", handle.vllm.remote_request_id)
        return keep

    async def _publish_batch(self, batch: list[_Item]) -> None:
        handles = []
        for item in batch:
            assert item.handle is not None
            handle = dataclasses.replace(
                item.handle,
                holder_node_id=self._node_template.node_id,
                holder_incarnation=self._incarnation,
            )
            handles.append(convert.handle_to_pb(handle))
        # A batch joins the trace of its first traced handle: batches hold one handle per finished
        # turn at a time unless the control plane was unreachable for a while.
        traced = next((item.trace_context for item in batch if item.trace_context), ())
        await self._meta.PublishHandles(
            metadata_pb2.PublishHandlesRequest(handles=handles),
            timeout=self._settings.rpc_timeout_s,
            metadata=(*self._call_metadata, *traced),
        )
        self._published += len(batch)

    async def _release_batch(self, batch: list[_Item]) -> None:
        await self._meta.ReportReleased(
            metadata_pb2.ReportReleasedRequest(
                node_id=self._node_template.node_id,
                incarnation=self._incarnation,
                remote_request_ids=[item.remote_request_id for item in batch],
            ),
            timeout=self._settings.rpc_timeout_s,
            metadata=self._call_metadata,
        )
        self._released_reported += len(batch)

    # ------------------------------------------------------------------ eviction commands

    async def _commands_loop(self) -> None:
        backoff = _Backoff(self._settings.backoff_initial_s, self._settings.backoff_max_s)
        while not self._is_stopping():
            await self._session_ready.wait()
            try:
                received = await self._run_command_stream()
                if received:
                    backoff.reset()
            except grpc.aio.AioRpcError as err:
                if err.code() in _REFUSED:
                    self._note_error("the eviction command stream", err)
                else:
                    if err.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                        log.info("eviction command stream: %s %s", err.code(), err.details())
                    self._rpc_errors += 1
            # The stream ended or failed: reconnect after a pause either way.
            await self._sleep_or_stop(backoff.next_delay())

    async def _run_command_stream(self) -> bool:
        acks: asyncio.Queue[eviction_pb2.CommandsRequest | None] = asyncio.Queue()
        await acks.put(
            eviction_pb2.CommandsRequest(
                hello=eviction_pb2.NodeHello(
                    node_id=self._node_template.node_id, incarnation=self._incarnation
                )
            )
        )

        async def outgoing() -> AsyncIterator[eviction_pb2.CommandsRequest]:
            while (msg := await acks.get()) is not None:
                yield msg

        call = self._evict.Commands(outgoing(), metadata=self._call_metadata)
        self._streams_opened += 1
        received = False
        demand = (
            asyncio.create_task(self._send_demand(acks), name="kvplane-agent-demand")
            if self._demand_fn is not None
            else None
        )
        try:
            async for command in call:
                received = True
                ok, error = self._apply(command)
                await acks.put(
                    eviction_pb2.CommandsRequest(
                        ack=eviction_pb2.CommandAck(command_id=command.command_id, ok=ok, error=error)
                    )
                )
        finally:
            if demand is not None:
                demand.cancel()
            await acks.put(None)
            call.cancel()
        return received

    async def _send_demand(self, out: asyncio.Queue[eviction_pb2.CommandsRequest | None]) -> None:
        """Puts the engine's demand on the stream: on change, on connect, and while it lasts."""
        assert self._demand_fn is not None and self._demand_wake is not None
        last = 0
        while True:
            try:
                blocks = max(0, int(self._demand_fn()))
            except Exception:
                log.exception("demand_fn failed; no demand reported")
                blocks = 0
            # Zero is sent once, when a demand ends; a lasting demand is repeated.
            if blocks or last:
                await out.put(
                    eviction_pb2.CommandsRequest(
                        demand=eviction_pb2.KvDemand(blocks=blocks, measured_unix_ms=int(time.time() * 1000))
                    )
                )
                self._demand_reports += 1
            last = blocks
            self._demand_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._demand_wake.wait(), self._settings.demand_refresh_s)

    def _apply(self, command: eviction_pb2.CommandsResponse) -> tuple[bool, str]:
        """Apply one command at most once; return the ack's (ok, error)."""
        if command.command_id in self._seen:
            self._seen.move_to_end(command.command_id)
            self._commands_duplicate += 1
            return True, ""
        kind = command.WhichOneof("command")
        try:
            if kind == "release":
                self._on_release(command.release.remote_request_id)
            elif kind == "drain":
                if self._on_drain is None:
                    return False, "this engine cannot drain"
                self._on_drain()
            else:
                return False, f"unknown command {kind!r}"
        except Exception as exc:
            log.exception("applying command %s failed", command.command_id)
            return False, f"{type(exc).__name__}: {exc}"
        self._seen[command.command_id] = True
        while len(self._seen) > self._settings.seen_commands_max:
            self._seen.popitem(last=False)
        self._commands_applied += 1
        return True, ""
