"""Publishes (PublishHandles) and release reports (ReportReleased), sent from the outbox in order,
consecutive items of one kind batched. Release reports wait up to `release_linger_s` for a publish
and then go with it (`released_remote_request_ids`): the control plane records them in the
publish's transaction.

A publish that keeps failing is retried (the node registers again when the control plane no
longer knows it; metadata takes a new lease when one is gone) until `publish_give_up_s` after its
first failure, or until the handle's wall-clock expiry: then it is given up with a warning naming
the handle, and its blocks are freed through `on_release` (nothing would ever reference them), so
that one handle never holds up the queue behind it for good. Runs on the agent's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from kvplane.connector.node_agent.control_plane import NOT_REGISTERED, RETRYABLE, Backoff, ControlPlane
from kvplane.connector.node_agent.outbox import Item, Outbox
from kvplane.services.common.model import convert
from kvplane.v1 import metadata_pb2

log = logging.getLogger(__name__)


class Sender:
    """Empties the outbox into the control plane."""

    def __init__(self, plane: ControlPlane, outbox: Outbox, on_release: Callable[[str], None]) -> None:
        self._plane = plane
        self._outbox = outbox
        self._on_release = on_release
        self.published = 0
        self.released_reported = 0
        self.publishes_given_up = 0
        # Relocations the metadata service refused: the handle they moved was no longer retained
        # (checked out, released or superseded), and what got there first frees the blocks.
        self.relocations_refused = 0
        # Publishes the control plane refused because their blocks were freed or left retention.
        self.publishes_refused_freed = 0
        # Whether release reports go with publishes: until a metadata service answers that it
        # recorded none of them (one older than `released_remote_request_ids`).
        self.releases_ride = True

    async def run(self) -> None:
        plane, wake = self._plane, self._outbox.wake
        assert wake is not None
        backoff = Backoff(plane.settings.backoff_initial_s, plane.settings.backoff_max_s)
        while not plane.is_stopping():
            wake.clear()
            await plane.session_ready.wait()
            linger_s = plane.settings.release_linger_s if self.releases_ride else 0.0
            try:
                sent = await self.send_one_batch(linger_s)
            except grpc.aio.AioRpcError as err:
                plane.note_error("publish/release", err)
                await plane.sleep_or_stop(backoff.next_delay())
                continue
            backoff.reset()
            if not sent:
                deadline = self._outbox.linger_deadline(linger_s)
                if deadline is None:
                    await wake.wait()
                    continue
                # Release reports wait for a publish to ride with: a new item, or their time up.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                        await wake.wait()

    async def send_one_batch(self, linger_s: float = 0.0) -> bool:
        """Send the head batch. False when the queue was empty, or held only release reports
        younger than `linger_s` with no publish behind them. Puts the batch back on errors."""
        async with self._plane.send_lock:
            return await self._send_head_batch(linger_s)

    async def _send_head_batch(self, linger_s: float) -> bool:
        batch = self._outbox.take_batch(linger_s)
        if not batch:
            return False
        releases = [item for item in batch if item.kind == "release"]
        publishes = self._give_up_stale([item for item in batch if item.kind == "publish"])
        try:
            if releases and not (publishes and self.releases_ride):
                await self._release_batch(releases)
                releases = []
            if publishes:
                recorded = await self._publish_batch(publishes, releases)
                publishes = []
                if not recorded:
                    await self._release_batch(releases)
                releases = []
        except grpc.aio.AioRpcError as err:
            # What is left unsent goes back, or is dropped.
            batch = [*releases, *publishes]
            if err.code() in RETRYABLE or err.code() in NOT_REGISTERED:
                now = time.monotonic()
                failing = [dataclasses.replace(i, failing_since=i.failing_since or now) for i in batch]
                self._outbox.put_back(failing)
            else:
                # INVALID_ARGUMENT and the like: resending cannot help.
                self._outbox.drop(len(batch))
                for item in batch:
                    _tell(item, stored=False)
                log.warning(
                    "dropping %d publish(es) and %d release report(s): %s %s",
                    len(publishes),
                    len(releases),
                    err.code(),
                    err.details(),
                )
            raise
        return True

    def _give_up_stale(self, batch: list[Item]) -> list[Item]:
        """The publishes still worth sending; the others are given up and their blocks freed.

        A handle past its wall-clock expiry is never handed out, and one whose publish kept
        failing for `publish_give_up_s` (re-registrations and new leases included) would
        otherwise be retried for good, holding up every item queued behind it.
        """
        now, now_ms = time.monotonic(), int(time.time() * 1000)
        keep: list[Item] = []
        for item in batch:
            handle = item.handle
            assert handle is not None
            if handle.wall_expiry_unix_ms <= now_ms:
                why = "it expired before it could be published"
            elif item.failing_since and now - item.failing_since >= self._plane.settings.publish_give_up_s:
                why = f"publishing it kept failing for {now - item.failing_since:.1f} s"
            else:
                keep.append(item)
                continue
            log.warning(
                "node %s gives up handle %s (tenant %s, conversation %s, request %s): %s; "
                "its blocks are freed",
                self._plane.node_id,
                handle.handle_id or "(no id)",
                handle.tenant,
                handle.conversation,
                handle.vllm.remote_request_id,
                why,
            )
            self.publishes_given_up += 1
            try:
                self._on_release(handle.vllm.remote_request_id)
            except Exception:
                log.exception("freeing request %s failed", handle.vllm.remote_request_id)
        return keep

    async def _publish_batch(self, batch: list[Item], releases: list[Item]) -> bool:
        """PublishHandles of `batch`, reporting `releases` (queued before it) in the same call;
        whether the service recorded them (False: one that predates the field ignored them)."""
        plane = self._plane
        handles = []
        for item in batch:
            assert item.handle is not None
            handle = dataclasses.replace(
                item.handle, holder_node_id=plane.node_id, holder_incarnation=plane.incarnation
            )
            handles.append(convert.handle_to_pb(handle))
        # A batch joins the trace of its first traced handle: batches hold one handle per finished
        # turn at a time unless the control plane was unreachable for a while.
        traced = next((item.trace_context for item in batch if item.trace_context), ())
        response = await plane.meta.PublishHandles(
            metadata_pb2.PublishHandlesRequest(
                handles=handles, released_remote_request_ids=[item.remote_request_id for item in releases]
            ),
            timeout=plane.settings.rpc_timeout_s,
            metadata=(*plane.call_metadata, *traced),
        )
        self.published += len(batch)
        recorded = len(releases) <= response.released_recorded
        if recorded:
            self.released_reported += len(releases)
        else:
            # A metadata service that predates the field ignored it: reported the old way, now
            # and from now on.
            log.info(
                "node %s: the metadata service does not record freed blocks with publishes;"
                " reporting them on their own",
                plane.node_id,
            )
            self.releases_ride = False
        for item, result in zip(batch, response.results, strict=False):
            _tell(item, stored=not (result.relocation_refused or result.blocks_freed))
            if result.blocks_freed:
                # A late publish, or one re-sent after an unseen success whose handle has since
                # been read or released: no turn will name these blocks, so they are freed here
                # rather than at the engine's TTL (where the engine freed them already, nothing).
                self.publishes_refused_freed += 1
                assert item.handle is not None
                request_id = item.handle.vllm.remote_request_id
                log.info(
                    "node %s: publish of request %s refused: its blocks were freed or left retention"
                    " already; freeing them",
                    plane.node_id,
                    request_id,
                )
                try:
                    self._on_release(request_id)
                except Exception:
                    log.exception("freeing request %s failed", request_id)
            if result.relocation_refused:
                self.relocations_refused += 1
                assert item.handle is not None
                log.info(
                    "node %s: relocation of handle %s (request %s) refused: it is no longer retained",
                    plane.node_id,
                    item.handle.relocates_handle_id,
                    item.handle.vllm.remote_request_id,
                )
        return recorded

    async def _release_batch(self, batch: list[Item]) -> None:
        plane = self._plane
        await plane.meta.ReportReleased(
            metadata_pb2.ReportReleasedRequest(
                node_id=plane.node_id,
                incarnation=plane.incarnation,
                remote_request_ids=[item.remote_request_id for item in batch],
            ),
            timeout=plane.settings.rpc_timeout_s,
            metadata=plane.call_metadata,
        )
        self.released_reported += len(batch)


def _tell(item: Item, *, stored: bool) -> None:
    """The engine's callback for a publish's outcome, if it asked for one."""
    if item.on_outcome is None:
        return
    try:
        item.on_outcome(stored)
    except Exception:
        log.exception("the outcome callback of a publish failed")
