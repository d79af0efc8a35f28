"""Remote loads: reading a holder's blocks over NIXL before a request computes, as vLLM does.

A P request that names D's handle pulls ``missing = min(remote_num_tokens, prompt_len) - local
hit`` tokens, or recomputes when ``0 < missing < kv_recompute_threshold`` or when D's deadline is
within ``expiry_guard_s`` (on this engine's clock, through the offset measured at the handshake);
either way it notifies D, which frees the blocks. A D request pulls P's blocks beyond its own
prefix cache. The uncached tail maps onto the tail of the remote block list.

Every pulled block is verified (block_content.py). A block that fails is never used: the load
counts as failed and the tokens are recomputed, as vLLM's ``kv_load_failure_policy="recompute"``
does. Peers (side-channel handshake, NIXL agent) are kept per address and made again when the
holder restarts. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from opentelemetry import trace

from kvplane.connector.simengine.block_content import BlockCheck, block_hashes, lease_stamp
from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.kv_params import RemoteBlocks
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.nixl_transport import (
    EngineNotStartedError,
    NixlTransport,
    RemoteAgent,
    TransferFailedError,
)
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import HandshakeError, PeerInfo, handshake, normalize_host

log = logging.getLogger(__name__)

Leg = Literal["local", "prefill", "decode"]


@dataclass(frozen=True)
class LoadOutcome:
    """What happened to a request's remote KV load."""

    outcome: str
    external_tokens: int


@dataclass
class _Peer:
    info: PeerInfo
    agent: RemoteAgent


class RemoteLoads:
    """One engine's reads of other engines' blocks."""

    def __init__(
        self,
        settings: SimEngineSettings,
        pool: BlockPool,
        metrics: SimEngineMetrics,
        transport: Callable[[], NixlTransport | None],
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        # The engine's NIXL agent: made when the engine starts, None once it stops.
        self._transport = transport
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peer_locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def load(
        self,
        leg: Leg,
        remote: RemoteBlocks,
        prompt: list[int],
        prompt_chain: list[int],
        blocks: list[int],
        hit_blocks: int,
    ) -> LoadOutcome:
        """Reads into `blocks` (the request's, after its `hit_blocks` cached ones) what the
        prompt lacks of the remote blocks, or says why not."""
        s, bs = self.settings, self.settings.block_size
        n = len(prompt)
        hit = hit_blocks * bs
        usable = min(remote.num_tokens if remote.num_tokens is not None else n, n)
        if leg == "prefill":
            usable = min(usable, n - 1)
        missing = usable - hit
        notif = json.dumps({"request_id": remote.request_id}).encode()
        if leg == "prefill" and 0 < missing < s.kv_recompute_threshold:
            await self._notify(remote, notif)
            return LoadOutcome("recompute_threshold", 0)
        if missing <= 0:
            await self._notify(remote, notif)
            return LoadOutcome("nothing_missing", 0)
        peer = await self._peer(remote)
        if peer is None:
            return LoadOutcome("handshake_failed", 0)
        info = peer.info
        if (info.model, info.block_size, info.bytes_per_block) != (s.model, bs, s.bytes_per_block):
            return LoadOutcome("incompatible", 0)
        if remote.incarnation is not None and remote.incarnation != info.incarnation:
            # The holder restarted: the handle names blocks of a previous life.
            return LoadOutcome("stale_incarnation", 0)
        if leg == "prefill" and remote.expiry_time is not None:
            local_expiry = remote.expiry_time - info.clock_offset_s
            if local_expiry - time.perf_counter() < s.expiry_guard_s:
                self._send_notif(peer, notif)
                return LoadOutcome("declined_expiry", 0)
        first, last = hit_blocks, math.ceil(usable / bs)
        count = last - first
        if count > len(remote.block_ids):
            self._send_notif(peer, notif)
            return LoadOutcome("too_few_remote_blocks", 0)
        return await self._read(remote, peer, prompt, prompt_chain, blocks[first:last], first, usable, notif)

    async def _read(
        self,
        remote: RemoteBlocks,
        peer: _Peer,
        prompt: list[int],
        prompt_chain: list[int],
        dst: list[int],
        first: int,
        usable: int,
        notif: bytes,
    ) -> LoadOutcome:
        """READ the remote blocks into `dst` (blocks `first`... of the prompt), then verify them."""
        s, bs = self.settings, self.settings.block_size
        info, count = peer.info, len(dst)
        # As vLLM does, the uncached tail maps onto the tail of the remote list.
        src = list(remote.block_ids[len(remote.block_ids) - count :])
        try:
            seconds = await self._require_transport().read(peer.agent, dst, src, notif, s.transfer_timeout_s)
        except TransferFailedError as e:
            log.warning("READ from %s failed: %s", remote.engine_id, e)
            self.metrics.transfer_failed()
            self._drop_peer(remote)
            return LoadOutcome("transfer_failed", 0)
        self.metrics.transfer(seconds, count * s.bytes_per_block)
        verify_start = time.perf_counter()
        hashes = block_hashes(prompt, bs, self.pool.root, usable, prompt_chain)
        stamp = lease_stamp(info.engine_id, info.incarnation, remote.request_id)
        bad, check = self.pool.content.check_many(self.pool.array, dst, hashes[first:], first, stamp)
        # The load's span (kv.pull) splits its time: the READ, then checking what it read.
        trace.get_current_span().set_attributes(
            {
                "kvplane.pull.read_ms": seconds * 1000,
                "kvplane.pull.verify_ms": (time.perf_counter() - verify_start) * 1000,
            }
        )
        if check is not BlockCheck.OK:
            self.metrics.verify_failure(check.value)
            log.warning(
                "pulled block %d of %s/%s failed verification (%s): recomputing",
                first + bad,
                remote.engine_id,
                remote.request_id,
                check.value,
            )
            return LoadOutcome("verify_failed", 0)
        return LoadOutcome("pulled", usable - first * bs)

    def _require_transport(self) -> NixlTransport:
        transport = self._transport()
        if transport is None:
            raise EngineNotStartedError("the engine is not started")
        return transport

    async def _peer(self, remote: RemoteBlocks) -> _Peer | None:
        key = (normalize_host(remote.host), remote.port)
        lock = self._peer_locks.setdefault(key, asyncio.Lock())
        async with lock:
            peer = self._peers.get(key)
            if (
                peer is not None
                and peer.info.engine_id == remote.engine_id
                and (remote.incarnation is None or remote.incarnation == peer.info.incarnation)
            ):
                return peer
            if peer is not None:
                self._drop_peer(remote)
            try:
                info = await handshake(
                    remote.host, remote.port, remote.engine_id, self.settings.handshake_timeout_s
                )
                agent = self._require_transport().add_remote(
                    info.agent_metadata, info.serialized_descs, info.num_blocks
                )
            except (HandshakeError, TransferFailedError) as e:
                log.warning(
                    "handshake with %s at %s:%d failed: %s", remote.engine_id, remote.host, remote.port, e
                )
                self.metrics.handshake("failed")
                return None
            except Exception as e:  # NIXL rejects bad metadata with its own exception types
                log.warning("adding NIXL agent of %s failed: %s", remote.engine_id, e)
                self.metrics.handshake("failed")
                return None
            self.metrics.handshake("ok")
            peer = _Peer(info, agent)
            self._peers[key] = peer
            return peer

    def _drop_peer(self, remote: RemoteBlocks) -> None:
        peer = self._peers.pop((normalize_host(remote.host), remote.port), None)
        if peer is not None:
            transport = self._transport()
            if transport is not None:
                transport.remove_remote(peer.agent)

    async def _notify(self, remote: RemoteBlocks, notif: bytes) -> None:
        peer = await self._peer(remote)
        if peer is not None:
            self._send_notif(peer, notif)

    def _send_notif(self, peer: _Peer, notif: bytes) -> None:
        try:
            self._require_transport().send_notif(peer.agent, notif)
        except TransferFailedError as e:
            log.warning("read notification to %s failed: %s", peer.info.engine_id, e)
