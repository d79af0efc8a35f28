"""The node's registration: RegisterNode under the incarnation, KeepAlive on the lease, registering
again when the lease is gone, and reconciling the handles the engine retains after each.

A failed refresh is retried within half a second, not a whole interval later: the lease keeps
running while the control plane restarts. Runs on the agent's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import grpc

from kvplane.connector.node_agent.control_plane import NOT_REGISTERED, Backoff, ControlPlane
from kvplane.connector.node_agent.outbox import Outbox
from kvplane.services.common.model import convert
from kvplane.v1 import metadata_pb2

log = logging.getLogger(__name__)

# ReconcileRetained takes at most this many ids per call (metadata.proto).
MAX_RECONCILE_BATCH = 1024
# The longest wait before a failed KeepAlive is sent again, in seconds: the lease keeps running.
KEEPALIVE_RETRY_MAX_S = 0.5


class Registration:
    """Keeps the node registered and its lease alive."""

    def __init__(
        self,
        plane: ControlPlane,
        outbox: Outbox,
        on_release: Callable[[str], None],
        retained_fn: Callable[[], Iterable[str]] | None,
    ) -> None:
        self._plane = plane
        self._outbox = outbox
        self._on_release = on_release
        # The request ids of the handles the engine retains; None: no reconciliation.
        self._retained_fn = retained_fn
        self.reconciled_freed = 0
        self._lease_id = 0
        self._granted_ttl_s = plane.settings.lease_ttl_s
        self._background: set[asyncio.Task[None]] = set()

    async def _register(self) -> None:
        plane, s = self._plane, self._plane.settings
        node = dataclasses.replace(
            plane.node_template, incarnation=plane.incarnation, registered_unix_ms=int(time.time() * 1000)
        )
        resp = await plane.meta.RegisterNode(
            metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=s.lease_ttl_s),
            timeout=s.rpc_timeout_s,
            metadata=plane.call_metadata,
        )
        self._lease_id = resp.lease_id
        self._granted_ttl_s = resp.lease_ttl_s or s.lease_ttl_s
        plane.registrations += 1
        plane.registered = True
        plane.reregister.clear()
        plane.session_ready.set()
        log.info(
            "registered node %s incarnation %s (lease %x, ttl %d s)",
            node.node_id,
            plane.incarnation,
            self._lease_id,
            self._granted_ttl_s,
        )

    async def run(self) -> None:
        """Registers, then refreshes the lease at a third of its TTL, until the agent stops."""
        plane = self._plane
        backoff = Backoff(plane.settings.backoff_initial_s, plane.settings.backoff_max_s)
        self._lease_id = 0
        retry_now = False
        while not plane.is_stopping():
            if not plane.session_ready.is_set():
                try:
                    await self._register()
                    backoff.reset()
                except grpc.aio.AioRpcError as err:
                    plane.note_error("RegisterNode", err)
                    await plane.sleep_or_stop(backoff.next_delay())
                    continue
                retry_now = False
                self._spawn(self._reconcile(), "kvplane-agent-reconcile")
            if not retry_now:
                # Refresh at a third of the lease so two lost refreshes are survivable.
                interval = max(0.2, self._granted_ttl_s / 3.0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await plane.reregister.wait()
            retry_now = False
            if not plane.session_ready.is_set():
                continue
            # Still registered: the wake-up (if any) asked for this keep-alive, which answers it.
            # Left set, the next wait would return at once, and keep-alives would follow one another
            # with no pause.
            plane.reregister.clear()
            try:
                await plane.meta.KeepAlive(
                    metadata_pb2.KeepAliveRequest(
                        node_id=plane.node_id, incarnation=plane.incarnation, lease_id=self._lease_id
                    ),
                    timeout=plane.settings.rpc_timeout_s,
                    metadata=plane.call_metadata,
                )
                backoff.reset()
            except grpc.aio.AioRpcError as err:
                plane.note_error("KeepAlive", err)
                if err.code() not in NOT_REGISTERED:
                    # The lease runs on while the control plane restarts: try again promptly.
                    await plane.sleep_or_stop(min(backoff.next_delay(), KEEPALIVE_RETRY_MAX_S))
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
        plane = self._plane
        incarnation = plane.incarnation
        try:
            async with plane.send_lock:
                held = list(dict.fromkeys(self._retained_fn()))
                unreferenced: list[str] = []
                for start in range(0, len(held), MAX_RECONCILE_BATCH):
                    resp = await plane.meta.ReconcileRetained(
                        metadata_pb2.ReconcileRetainedRequest(
                            node_id=plane.node_id,
                            incarnation=incarnation,
                            remote_request_ids=held[start : start + MAX_RECONCILE_BATCH],
                        ),
                        timeout=plane.settings.rpc_timeout_s,
                        metadata=plane.call_metadata,
                    )
                    unreferenced += resp.unreferenced_request_ids
                queued = {
                    item.handle.vllm.remote_request_id
                    for item in self._outbox.items()
                    if item.kind == "publish" and item.handle is not None
                }
        except grpc.aio.AioRpcError as err:
            # The next registration reconciles again; until then the engine's TTL bounds the loss.
            plane.note_error("ReconcileRetained", err)
            return
        self._free(unreferenced, queued)

    def _free(self, unreferenced: list[str], queued: set[str]) -> None:
        for request_id in unreferenced:
            if request_id in queued:
                continue
            try:
                self._on_release(request_id)
            except Exception:
                log.exception("freeing unreferenced request %s failed", request_id)
                continue
            self.reconciled_freed += 1
        if unreferenced:
            log.warning(
                "node %s freed %d retained handle(s) nothing referenced any more",
                self._plane.node_id,
                len(unreferenced),
            )
