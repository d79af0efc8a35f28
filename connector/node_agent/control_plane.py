"""What the node agent's jobs share on its thread: the stubs, the call metadata, the registration
state and the stop flag.

Everything here but the counters is used on the agent's thread only; `registered`,
`registrations` and `rpc_errors` are plain ints and bools read by `NodeAgent.stats()` from any
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import grpc

from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.client.credentials import CallMetadata
from kvplane.services.common.model.nodes import Node
from kvplane.v1 import eviction_pb2_grpc, metadata_pb2_grpc

log = logging.getLogger(__name__)

# Status codes after which a call is worth repeating, later.
RETRYABLE = frozenset(
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
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
# Status codes that mean "this node or incarnation is not (or no longer) registered".
NOT_REGISTERED = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})
# Channels to the control plane reconnect within a second of a restarted service being back,
# not after gRPC's default backoff (up to two minutes).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class Backoff:
    """Exponential backoff with full jitter, drawn from a generator of its own: agents whose
    `random` module was seeded alike (a test framework's, per example) do not retry in step."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._initial = initial_s
        self._max = max_s
        self._attempt = 0
        self._rng = random.Random()

    def reset(self) -> None:
        self._attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self._max, self._initial * (2**self._attempt))
        self._attempt = min(self._attempt + 1, 32)
        return self._rng.uniform(0.0, ceiling)


class ControlPlane:
    """The agent's view of the control plane, shared by its jobs."""

    def __init__(self, settings: NodeAgentSettings, node: Node) -> None:
        self.settings = settings
        self.node_template = node
        self.node_id = node.node_id
        # The incarnation of the current start; empty before the first.
        self.incarnation = ""
        # Sent with every call. The control plane takes the node's identity from the credentials
        # (token or certificate); the headers name it only for a mesh proxy to vouch for.
        self.credentials = settings.credentials.merged(token=settings.auth_token)
        self._metadata = CallMetadata(
            self.credentials, (("x-kvplane-role", "node"), ("x-kvplane-node", node.node_id))
        )
        self._last_refusal = ""
        # Counters, read by stats() from any thread.
        self.registered = False
        self.registrations = 0
        self.rpc_errors = 0
        # Made on the agent's loop by open(), for each start.
        self.meta: metadata_pb2_grpc.MetadataServiceAsyncStub
        self.evict: eviction_pb2_grpc.EvictionServiceAsyncStub
        self.stopping: asyncio.Event | None = None
        self.session_ready = asyncio.Event()
        self.reregister = asyncio.Event()
        # Held while a publish batch is in flight, and while reconciling: a handle being
        # published is never taken for an unreferenced one.
        self.send_lock = asyncio.Lock()

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with every call; a rotated token file is read again (CallMetadata)."""
        return self._metadata.current()

    def open(
        self, meta_channel: grpc.aio.Channel, evict_channel: grpc.aio.Channel, stopping: asyncio.Event
    ) -> None:
        """A start's stubs and events, made on the agent's loop."""
        self.stopping = stopping
        self.session_ready = asyncio.Event()
        self.reregister = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.meta = metadata_pb2_grpc.MetadataServiceStub(meta_channel)
        self.evict = eviction_pb2_grpc.EvictionServiceStub(evict_channel)

    def note_error(self, what: str, err: grpc.aio.AioRpcError) -> None:
        self.rpc_errors += 1
        if err.code() in REFUSED:
            # Misconfigured credentials leave the engine unregistered: say so where operators look,
            # once per distinct refusal rather than at every retry.
            refusal = f"{err.code().name}: {err.details()}"
            if refusal != self._last_refusal:
                self._last_refusal = refusal
                log.warning(
                    "the control plane refused %s for node %s (%s); presenting %s",
                    what,
                    self.node_id,
                    refusal,
                    self.credentials.describe(),
                )
        else:
            log.debug("%s failed: %s %s", what, err.code(), err.details())
        if err.code() in NOT_REGISTERED:
            self.mark_unregistered()

    def mark_unregistered(self) -> None:
        self.registered = False
        self.session_ready.clear()
        self.reregister.set()

    def is_stopping(self) -> bool:
        return self.stopping is not None and self.stopping.is_set()

    async def sleep_or_stop(self, delay_s: float, wake: asyncio.Event | None = None) -> None:
        """Returns after `delay_s`, or sooner when the agent stops or `wake` is set."""
        stopping = self.stopping
        assert stopping is not None
        if wake is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await stopping.wait()
            return
        waits = [asyncio.ensure_future(stopping.wait()), asyncio.ensure_future(wake.wait())]
        try:
            await asyncio.wait(waits, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
