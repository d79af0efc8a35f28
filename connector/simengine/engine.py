"""The simulated engine: scheduling, KV loads over NIXL, retention and its release.

It follows vLLM's NixlConnector semantics (PROTOCOL.md):

- A request with ``do_remote_decode`` (the P leg) keeps its blocks after it
  finishes and returns P's params; they stay until D's read notification or
  ``prefill_lease_s``.
- A request with ``do_remote_prefill`` (the D leg) pulls P's blocks first.
  With bidirectional transfer on, at a natural finish it keeps its blocks for
  ``decoder_kv_blocks_ttl`` and returns its handle with ``do_remote_decode``.
- A P request that names D's handle pulls ``missing = min(remote_num_tokens,
  prompt_len) - local hit`` tokens, or recomputes when ``0 < missing <
  kv_recompute_threshold`` or when D's deadline is within ``expiry_guard_s``;
  either way it notifies D, which frees the blocks.

Every pulled block is verified (block_content.py). A block that fails is
never used: the load counts as failed and the tokens are recomputed, as
vLLM's ``kv_load_failure_policy="recompute"`` does.

Compute is simulated with asyncio.sleep of the modelled duration: one prefill
at a time (FIFO), decode steps concurrent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from opentelemetry import trace

from kvplane.connector.simengine.block_content import (
    BlockCheck,
    block_hashes,
    chain_hash,
    full_block_hashes,
    lease_stamp,
    root_hash,
    salt_key,
)
from kvplane.connector.simengine.block_pool import BlockPool, KvCacheFullError
from kvplane.connector.simengine.engine_hooks import EngineLoad, EngineObserver, NullObserver
from kvplane.connector.simengine.kv_params import RemoteBlocks, holder_params, parse_remote
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.nixl_transport import NixlTransport, RemoteAgent, TransferFailedError
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import (
    HandshakeError,
    LocalIdentity,
    PeerInfo,
    SideChannelServer,
    handshake,
    normalize_host,
)
from kvplane.connector.simengine.token_oracle import TokenOracle
from kvplane.connector.simengine.toy_tokenizer import BYTE_OFFSET, EOS_ID, think_close, think_open
from kvplane.services.common.model.handles import KEY_PULLED_TOKENS, KEY_RETAIN

log = logging.getLogger(__name__)

RetainKind = Literal["decode_handle", "prefill_lease"]
_RECENTLY_FREED_MAX = 4096


class EngineNotStartedError(Exception):
    """generate() was called before start()."""


@dataclass(frozen=True)
class GenerationRequest:
    """One completion request, already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    kv_transfer_params: Mapping[str, Any] | None = None
    # Output opens with <think>, this many model tokens, </think> (chat reasoning).
    reasoning_tokens: int = 0
    # vLLM's `cache_salt`: the prefix cache is shared only between requests with the same salt.
    cache_salt: str | None = None


@dataclass(frozen=True)
class FinishInfo:
    """How a request ended; carried by its last token."""

    finish_reason: Literal["stop", "length"]
    output_token_ids: tuple[int, ...]
    # Prompt tokens whose KV was not computed here (local cache hit + pulled).
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # Of those, the tokens whose KV was read from a remote engine over NIXL.
    pulled_tokens: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``finish`` is set on the last one."""

    token_id: int
    finish: FinishInfo | None = None


@dataclass(frozen=True)
class LoadOutcome:
    """What happened to a request's remote KV load."""

    outcome: str
    external_tokens: int


@dataclass
class _Retained:
    request_id: str
    kind: RetainKind
    block_ids: list[int]
    num_tokens: int
    stamp: int
    expiry: float  # perf_counter
    nbytes: int


@dataclass
class _Peer:
    info: PeerInfo
    agent: RemoteAgent


class SimEngine:
    """One simulated engine. All methods run on one event loop."""

    # Spans of the engine's own steps (the pull), children of the request's span; the server sets it.
    tracer: trace.Tracer = trace.NoOpTracer()

    def __init__(
        self, settings: SimEngineSettings, observer: EngineObserver | None = None, incarnation: str = ""
    ) -> None:
        self.settings = settings
        self.engine_id = settings.resolved_engine_id()
        # Pass the node agent's incarnation so the registered node and the lease stamps agree.
        self.incarnation = incarnation or uuid.uuid4().hex
        self.observer: EngineObserver = observer or NullObserver()
        self.pool = BlockPool(
            settings.num_blocks, settings.bytes_per_block, settings.block_size, root_hash(settings.model)
        )
        self.oracle = TokenOracle(settings.seed, settings.eos_probability)
        self._think_open, self._think_close = think_open(), think_close()
        self.metrics = SimEngineMetrics(settings.model)
        self.side_channel = SideChannelServer(
            self._identity, settings.side_channel_host, settings.side_channel_port
        )
        self._transport: NixlTransport | None = None
        self._retained: dict[str, _Retained] = {}
        self._retained_bytes = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recently_freed: OrderedDict[str, str] = OrderedDict()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._peer_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._prefill_lock = asyncio.Lock()
        self._blocks_freed = asyncio.Event()
        # KV demand (event-loop thread): blocks that requests wait for.
        self._kv_wanted = 0
        # Release commands taken and not yet carried out: request id -> blocks. Written from
        # the node agent's thread too, hence the lock.
        self._freeing: dict[str, int] = {}
        self._freeing_lock = threading.Lock()
        # Called (event-loop thread, must not block) when requests start or stop waiting for KV.
        self.demand_listener: Callable[[], None] | None = None
        self._queued = 0
        self._queued_tokens = 0
        self._running = 0
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport = NixlTransport(f"{self.engine_id}:{self.incarnation[:12]}", self.pool)
        await self.side_channel.start()
        self._tasks = [
            asyncio.create_task(self._notification_loop(), name="simengine-notifs"),
            asyncio.create_task(self._reaper_loop(), name="simengine-reaper"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self.side_channel.stop()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @property
    def side_channel_port(self) -> int:
        return self.side_channel.port

    def _identity(self) -> LocalIdentity:
        t = self._require_transport()
        s = self.settings
        return LocalIdentity(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            model=s.model,
            block_size=s.block_size,
            bytes_per_block=s.bytes_per_block,
            num_blocks=s.num_blocks,
            registration_generation=0,
            agent_metadata=t.metadata(),
            serialized_descs=t.serialized_descs(),
        )

    def _require_transport(self) -> NixlTransport:
        if self._transport is None:
            raise EngineNotStartedError("the engine is not started")
        return self._transport

    # -- the control-plane seam (EngineControl) ---------------------------

    def load(self) -> EngineLoad:
        return EngineLoad(
            queued_requests=self._queued,
            queued_prefill_tokens=self._queued_tokens,
            running_requests=self._running,
            free_kv_blocks=self.pool.free_blocks,
            total_kv_blocks=self.pool.num_blocks,
            retained_bytes=self._retained_bytes,
            retained_handles=len(self._retained),
        )

    def adopt_incarnation(self, incarnation: str) -> None:
        """Take the node agent's incarnation; call before the engine serves traffic."""
        self.incarnation = incarnation

    def kv_demand_blocks(self) -> int:
        """Blocks wanted beyond those free and those already being freed. Any thread.

        What waiting requests need, plus the free-block watermark
        (``kv_free_watermark_blocks``), less the free blocks and the blocks of
        release commands taken and not yet carried out: the control plane has
        already answered those.
        """
        with self._freeing_lock:
            freeing = sum(self._freeing.values())
        wanted = self._kv_wanted + self.settings.kv_free_watermark_blocks
        return max(0, wanted - self.pool.free_blocks - freeing)

    def release_early(self, request_id: str) -> bool:
        held = self._retained.get(request_id)
        if held is not None:
            # Counted as on its way before the command is acknowledged: a demand report sent
            # after the ack must not ask for these blocks again.
            with self._freeing_lock:
                self._freeing[request_id] = len(held.block_ids)
        self._on_loop(self._release_if_held, request_id)
        return held is not None

    def drain(self) -> None:
        self._draining = True
        self._on_loop(self._release_all)

    def _on_loop(self, fn: Any, *args: Any) -> None:
        """Run fn now when on the engine's loop, else schedule it there (the agent has its own thread)."""
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is self._loop or self._loop is None:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _release_if_held(self, request_id: str) -> None:
        if request_id in self._retained:
            self._free(request_id, "early")
        with self._freeing_lock:
            self._freeing.pop(request_id, None)

    def _release_all(self) -> None:
        for request_id in list(self._retained):
            self._free(request_id, "drain")

    def retained_handle_ids(self) -> list[str]:
        """Request ids of the decode handles held; from any thread (the values are copied in one step)."""
        return [r.request_id for r in list(self._retained.values()) if r.kind == "decode_handle"]

    def retained(self) -> list[dict[str, Any]]:
        now = time.perf_counter()
        return [
            {
                "request_id": r.request_id,
                "kind": r.kind,
                "num_tokens": r.num_tokens,
                "num_blocks": len(r.block_ids),
                "bytes": r.nbytes,
                "expires_in_s": r.expiry - now,
            }
            for r in self._retained.values()
        ]

    # -- requests ---------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Run one request, yielding its tokens. Closing the iterator early aborts it."""
        self._require_transport()
        s, bs = self.settings, self.settings.block_size
        prompt = list(req.prompt_token_ids)
        n = len(prompt)
        kvp = req.kv_transfer_params or {}
        leg: Literal["local", "prefill", "decode"] = "local"
        retain: RetainKind | None = None
        if kvp.get("do_remote_prefill"):
            leg = "decode"
            # Routing may find the turn's KV not worth keeping for the next one (kvplane_retain).
            retain = "decode_handle" if s.bidirectional and kvp.get(KEY_RETAIN) is not False else None
        elif kvp.get("do_remote_decode"):
            leg, retain = "prefill", "prefill_lease"
        remote = None
        if leg != "local":
            if leg == "prefill":
                # The control plane's prefix check may clip D's handle first, as in the vLLM connector.
                kvp = dict(kvp)
                try:
                    self.observer.check_pull(kvp, req.prompt_token_ids)
                except Exception:
                    log.exception("observer failed in check_pull")
            remote = parse_remote(kvp)

        t_arrival = time.perf_counter()
        blocks: list[int] = []
        running = False
        done = False
        self._queued += 1
        queued_tokens = n
        self._queued_tokens += n
        queued = True
        try:
            # Keep at least one prompt token to compute: its logits give the first token.
            prompt_chain = full_block_hashes(prompt, bs, self.pool.root)
            salt = salt_key(req.cache_salt)
            hit_blocks = self.pool.match_prefix(prompt_chain, salt) if s.enable_prefix_caching else []
            hit_blocks = hit_blocks[: (n - 1) // bs]
            self.pool.acquire(hit_blocks)
            blocks = list(hit_blocks)
            hit = len(hit_blocks) * bs
            self._queued_tokens -= hit
            queued_tokens -= hit
            blocks += await self._allocate(math.ceil(n / bs) - len(blocks))
            external = 0
            if leg != "local" and remote is not None:
                # Like vLLM's WAITING_FOR_REMOTE_KVS: the pull runs outside the compute queue.
                hits = len(hit_blocks)
                with self.tracer.start_as_current_span("kv.pull", attributes={"kvplane.leg": leg}) as span:
                    result = await self._load_remote(leg, remote, prompt, prompt_chain, blocks, hits)
                    span.set_attribute("kvplane.pull.outcome", result.outcome)
                    span.set_attribute("kvplane.tokens.pulled", result.external_tokens)
                external = result.external_tokens
                self._queued_tokens -= external
                queued_tokens -= external
                self.metrics.load_outcome(leg, result.outcome)
            async with self._prefill_lock:
                self._queued -= 1
                self._queued_tokens -= queued_tokens
                queued = False
                self._running += 1
                running = True
                computed = n - hit - external
                await asyncio.sleep(s.timing.prefill_s(computed))
                self.pool.write_tokens(blocks, prompt, n, len(hit_blocks), prompt_chain, salt)
                self.metrics.count_prompt(hit, external, computed)
                trace.get_current_span().set_attributes(
                    {
                        "kvplane.leg": leg,
                        "kvplane.tokens.prompt": n,
                        "kvplane.tokens.pulled": external,
                        "kvplane.tokens.prefill_cache": hit,
                        "kvplane.tokens.computed": computed,
                    }
                )

            # The oracle state: the chain of whole blocks, then the tokens after it.
            last_full = prompt_chain[-1] if prompt_chain else self.pool.root
            tail_start = len(prompt_chain) * bs
            state = self.oracle.state_after(prompt[tail_start:], self.oracle.base(last_full))
            out: list[int] = []
            tok = self._next_token(req, 0, state)
            while True:
                out.append(tok)
                if (n + len(out)) % bs == 0:
                    block = out[-bs:] if len(out) >= bs else prompt[n - (bs - len(out)) :] + out
                    last_full = chain_hash(last_full, block)
                    state = self.oracle.base(last_full)
                else:
                    state = self.oracle.state_after((tok,), state)
                if len(out) == 1:
                    self.metrics.first_token(time.perf_counter() - t_arrival)
                stop = tok == EOS_ID and not req.ignore_eos
                if stop or len(out) >= req.max_tokens or n + len(out) >= s.max_model_len:
                    finish = self._finish(
                        req,
                        retain,
                        prompt,
                        prompt_chain,
                        out,
                        blocks,
                        "stop" if stop else "length",
                        hit + external,
                        external,
                    )
                    blocks = []  # owned by the retained handle, or released
                    done = True
                    running = False
                    self._running -= 1
                    yield TokenEvent(tok, finish)
                    return
                yield TokenEvent(tok)
                # The next step computes KV for the token just emitted.
                if n + len(out) > len(blocks) * bs:
                    blocks += await self._allocate(1)
                await asyncio.sleep(s.timing.decode_s(self._running))
                tok = self._next_token(req, len(out), state)
        finally:
            # Reached with blocks still owned only on abort or error: free, return nothing.
            if queued:
                self._queued -= 1
                self._queued_tokens -= queued_tokens
            if running:
                self._running -= 1
            if blocks:
                self.pool.release(blocks)
                self._blocks_freed.set()
            if not done:
                self.metrics.finished("abort", 0)

    def _next_token(self, req: GenerationRequest, index: int, state: int) -> int:
        """Output token ``index``: the oracle's, inside the fixed think tags when reasoning."""
        if req.reasoning_tokens > 0:
            if index < len(self._think_open):
                return self._think_open[index]
            index -= len(self._think_open)
            if index < req.reasoning_tokens:
                tok = self.oracle.next_token(state)
                return BYTE_OFFSET + ord(" ") if tok == EOS_ID else tok  # reasoning never ends the answer
            index -= req.reasoning_tokens
            if index < len(self._think_close):
                return self._think_close[index]
        return self.oracle.next_token(state)

    async def _allocate(self, count: int) -> list[int]:
        if count <= 0:
            return []
        deadline = time.perf_counter() + self.settings.kv_wait_timeout_s
        waiting = False
        try:
            while True:
                try:
                    return self.pool.allocate(count)
                except KvCacheFullError:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise
                    if not waiting:
                        waiting = True
                        self._kv_wanted += count
                        self._demand_changed()
                    self._blocks_freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._blocks_freed.wait(), timeout=left)
        finally:
            if waiting:
                self._kv_wanted -= count
                self._demand_changed()

    def _demand_changed(self) -> None:
        if self.demand_listener is not None:
            try:
                self.demand_listener()
            except Exception:
                log.exception("demand listener failed")

    def _finish(
        self,
        req: GenerationRequest,
        retain: RetainKind | None,
        prompt: list[int],
        prompt_chain: list[int],
        out: list[int],
        blocks: list[int],
        reason: Literal["stop", "length"],
        cached_tokens: int,
        pulled_tokens: int,
    ) -> FinishInfo:
        s, bs = self.settings, self.settings.block_size
        all_tokens = prompt + out
        # The last token was sampled but never fed back, so it has no KV.
        num_kv = len(all_tokens) - 1
        keep = math.ceil(num_kv / bs)
        if blocks[keep:]:
            self.pool.release(blocks[keep:])
        blocks = blocks[:keep]
        self.pool.write_tokens(
            blocks, all_tokens, num_kv, min(len(prompt) // bs, keep), prompt_chain, salt_key(req.cache_salt)
        )
        self.metrics.finished(reason, len(out))
        params: dict[str, Any] | None = None
        stamp = lease_stamp(self.engine_id, self.incarnation, req.request_id)
        if retain == "decode_handle" and self._draining:
            retain = None  # a draining engine keeps nothing for later turns
        if retain is not None and blocks:
            # Copies of shared blocks may use the pool down to a tenth free, no further.
            lease = self.pool.lease(blocks, stamp, reserve_blocks=self.pool.num_blocks // 10)
            blocks = lease.block_ids
            self.metrics.shared_blocks(lease.copied, lease.restamped)
            ttl = s.decoder_kv_blocks_ttl if retain == "decode_handle" else s.prefill_lease_s
            expiry = time.perf_counter() + ttl
            r = _Retained(
                req.request_id, retain, blocks, num_kv, stamp, expiry, len(blocks) * s.bytes_per_block
            )
            self._retained[req.request_id] = r
            self._retained_bytes += r.nbytes
            params = holder_params(
                as_decode_handle=retain == "decode_handle",
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                request_id=req.request_id,
                block_ids=blocks,
                host=s.advertised_side_channel_host,
                port=self.side_channel_port,
                num_tokens=num_kv,
                expiry_time=expiry,
            )
            if retain == "prefill_lease":
                # What was pulled, as the engine saw it: the gateway counts it apart from cache hits.
                params[KEY_PULLED_TOKENS] = pulled_tokens
            if retain == "decode_handle":
                try:
                    self.observer.on_handle_retained(
                        params, all_tokens, r.nbytes, req.kv_transfer_params or {}
                    )
                except Exception:
                    log.exception("observer failed in on_handle_retained")
        elif blocks:
            self.pool.release(blocks)
            self._blocks_freed.set()
        return FinishInfo(reason, tuple(out), cached_tokens, params, pulled_tokens)

    # -- pulling ----------------------------------------------------------

    async def _load_remote(
        self,
        leg: Literal["local", "prefill", "decode"],
        remote: RemoteBlocks,
        prompt: list[int],
        prompt_chain: list[int],
        blocks: list[int],
        hit_blocks: int,
    ) -> LoadOutcome:
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
        # As vLLM does, the uncached tail maps onto the tail of the remote list.
        src = list(remote.block_ids[len(remote.block_ids) - count :])
        dst = blocks[first:last]
        try:
            seconds = await self._require_transport().read(peer.agent, dst, src, notif, s.transfer_timeout_s)
        except TransferFailedError as e:
            log.warning("READ from %s failed: %s", remote.engine_id, e)
            self.metrics.transfer_failed()
            self._drop_peer(remote)
            return LoadOutcome("transfer_failed", 0)
        self.metrics.transfer(seconds, count * s.bytes_per_block)
        hashes = block_hashes(prompt, bs, self.pool.root, usable, prompt_chain)
        stamp = lease_stamp(info.engine_id, info.incarnation, remote.request_id)
        bad, check = self.pool.content.check_many(self.pool.array, dst, hashes[first:], first, stamp)
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
        return LoadOutcome("pulled", usable - hit)

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
        if peer is not None and self._transport is not None:
            self._transport.remove_remote(peer.agent)

    async def _notify(self, remote: RemoteBlocks, notif: bytes) -> None:
        peer = await self._peer(remote)
        if peer is not None:
            self._send_notif(peer, notif)

    def _send_notif(self, peer: _Peer, notif: bytes) -> None:
        try:
            self._require_transport().send_notif(peer.agent, notif)
        except TransferFailedError as e:
            log.warning("read notification to %s failed: %s", peer.info.engine_id, e)

    # -- holding ----------------------------------------------------------

    def _free(self, request_id: str, reason: str) -> None:
        r = self._retained.pop(request_id)
        self._retained_bytes -= r.nbytes
        self.pool.unlease(r.block_ids, r.stamp)
        self.pool.release(r.block_ids)
        self._recently_freed[request_id] = reason
        while len(self._recently_freed) > _RECENTLY_FREED_MAX:
            self._recently_freed.popitem(last=False)
        self.metrics.freed(r.kind, reason)
        self._blocks_freed.set()
        if r.kind == "decode_handle":
            try:
                self.observer.on_blocks_freed(request_id)
            except Exception:
                log.exception("observer failed in on_blocks_freed")

    def _on_notification(self, msg: bytes) -> None:
        try:
            request_id = json.loads(msg)["request_id"]
        except (ValueError, KeyError, TypeError):
            self.metrics.unmatched_notif("malformed")
            return
        if not isinstance(request_id, str):
            self.metrics.unmatched_notif("malformed")
        elif request_id in self._retained:
            self._free(request_id, "read")
        elif request_id in self._recently_freed:
            # A second read of a consumed or expired handle: the reader got unleased blocks.
            self.metrics.unmatched_notif(f"after_{self._recently_freed[request_id]}")
        else:
            self.metrics.unmatched_notif("unknown")

    async def _notification_loop(self) -> None:
        transport = self._require_transport()
        while True:
            try:
                for _agent, msg in transport.poll_notifs():
                    self._on_notification(msg)
            except Exception:
                # A lost poll must not stop every later free: log and keep polling.
                log.exception("polling NIXL notifications failed")
            # Polling drives UCX progress (no progress thread); poll briskly only while holding.
            await asyncio.sleep(0.005 if self._retained else 0.05)

    async def _reaper_loop(self) -> None:
        while True:
            now = time.perf_counter()
            for r in [r for r in self._retained.values() if r.expiry <= now]:
                try:
                    self._free(r.request_id, "ttl")
                    self.metrics.expired()
                except Exception:
                    log.exception("freeing expired %s failed", r.request_id)
                    self._retained.pop(r.request_id, None)
            nxt = min((r.expiry for r in self._retained.values()), default=now + 0.1)
            await asyncio.sleep(min(max(nxt - time.perf_counter(), 0.001), 0.1))
