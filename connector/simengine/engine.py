"""The simulated engine: its scheduler, and its face to the HTTP API and the node agent.

It follows vLLM's NixlConnector semantics (PROTOCOL.md):

- A request with ``do_remote_decode`` (the P leg) keeps its blocks after it
  finishes and returns P's params; they stay until D's read notification or
  ``prefill_lease_s``.
- A request with ``do_remote_prefill`` (the D leg) pulls P's blocks first.
  With bidirectional transfer on, at a natural finish it keeps its blocks for
  ``decoder_kv_blocks_ttl`` and returns its handle with ``do_remote_decode``.
- A P request that names D's handle pulls what its prefix cache lacks, or
  recomputes; either way it notifies D, which frees the blocks.
- A request with kv_transfer_params but neither flag (a turn D prefills
  itself, routed ``prefill_on_decode``) computes what its prefix cache lacks
  and, like the D leg, keeps its blocks at a natural finish: vLLM treats any
  request with params that is not a P leg as D's.

By job: this module schedules requests (queueing, the prefix cache, KV
allocation and the demand it reports, one prefill at a time, decode steps);
``remote_loads.py`` reads other engines' blocks over NIXL and verifies them;
``retention.py`` keeps finished requests' blocks for remote readers and frees
them (read, deadline, release command, drain).

Compute is simulated with asyncio.sleep of the modelled duration: one prefill
at a time (FIFO), decode steps concurrent. A prefill of a request that is
neither leg of a P/D turn (D prefilling a turn itself) shares the engine's
steps with its running decodes, as vLLM's mixed batches do: a decode step that
ends while it runs waits for its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry import trace

from kvplane.connector.simengine.block_content import chain_hash, full_block_hashes, root_hash, salt_key
from kvplane.connector.simengine.block_pool import BlockPool, KvCacheFullError
from kvplane.connector.simengine.engine_hooks import EngineLoad, EngineObserver, NullObserver
from kvplane.connector.simengine.kv_event_publisher import KVEventPublisher
from kvplane.connector.simengine.kv_event_recorder import KVEventRecorder, RequestBlocks
from kvplane.connector.simengine.kv_params import RemoteBlocks, parse_remote
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.nixl_transport import EngineNotStartedError, NixlTransport
from kvplane.connector.simengine.remote_loads import Leg, RemoteLoads
from kvplane.connector.simengine.retention import RetainKind, Retention
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import LocalIdentity, SideChannelServer
from kvplane.connector.simengine.timeline import Timeline
from kvplane.connector.simengine.token_oracle import TokenOracle
from kvplane.connector.simengine.toy_tokenizer import BYTE_OFFSET, EOS_ID, think_close, think_open
from kvplane.services.common.model.handles import KEY_RETAIN
from kvplane.services.common.model.nodes import tokens_left

log = logging.getLogger(__name__)

# `SimEngine._computing` while no prefill computes: it has nothing left.
_NOT_COMPUTING = (0.0, 0.0, 0)


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
    # vLLM's session id (the `session_id` field or the X-Session-ID header), named in KV events.
    session_id: str | None = None


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


@dataclass
class _Run:
    """One request in flight: what it owns and where it is counted (freed on abort or error)."""

    prompt: list[int]
    t_arrival: float
    blocks: list[int] = field(default_factory=list)
    # Counted among the queued requests, with this many prompt tokens still to compute.
    queued: bool = True
    queued_tokens: int = 0
    running: bool = False
    done: bool = False
    prompt_chain: list[int] = field(default_factory=list)
    salt: int = 0
    # Its blocks as vLLM's KV events name them (events on).
    event_blocks: RequestBlocks | None = None
    hit_blocks: int = 0
    # Prompt tokens from the prefix cache, and pulled from a remote engine.
    hit: int = 0
    external: int = 0
    # How long the pull of the external tokens took (ms).
    pull_ms: float = 0.0
    # How long the prompt waited for the engine's compute, the pull left out (ms); -1: not yet.
    queued_ms: float = -1.0
    first_token_at: float = 0.0  # perf_counter


class SimEngine:
    """One simulated engine. All methods run on one event loop, but the thread-safe
    ``EngineControl`` ones (``release_early``, ``drain``, ``load``, ``kv_demand_blocks``,
    ``retained_handle_ids``), which the node agent calls from its own thread."""

    # Spans of the engine's own steps (the pull), children of the request's span; the server sets it.
    tracer: trace.Tracer = trace.NoOpTracer()

    def __init__(
        self, settings: SimEngineSettings, observer: EngineObserver | None = None, incarnation: str = ""
    ) -> None:
        self.settings = settings
        # Whether D retains a finished turn's KV (vLLM's bidirectional_kv_xfer): from the settings,
        # and switchable at run time (`POST /sim/bidirectional`) so that one set of engines can
        # serve, in turn, fronts whose users run vLLM with it on and with it off.
        self.bidirectional = settings.bidirectional
        self.engine_id = settings.resolved_engine_id()
        # Pass the node agent's incarnation so the registered node and the lease stamps agree.
        self.incarnation = incarnation or uuid.uuid4().hex
        self.pool = BlockPool(
            settings.num_blocks,
            settings.bytes_per_block,
            settings.block_size,
            root_hash(settings.model),
            host_blocks=settings.host_kv_blocks,
        )
        self.oracle = TokenOracle(settings.seed, settings.eos_probability)
        self._think_open, self._think_close = think_open(), think_close()
        self.metrics = SimEngineMetrics(settings.model)
        self.timeline = Timeline()
        self.side_channel = SideChannelServer(
            self._identity, settings.side_channel_host, settings.side_channel_port
        )
        self._transport: NixlTransport | None = None
        self.retention = Retention(settings, self.pool, self.metrics, self)
        self.remote_loads = RemoteLoads(settings, self.pool, self.metrics, lambda: self._transport)
        self.observer = observer or NullObserver()
        self._prefill_lock = asyncio.Lock()
        # KV demand (event-loop thread): blocks that requests wait for.
        self._kv_wanted = 0
        # Called (event-loop thread, must not block) when requests start or stop waiting for KV.
        self.demand_listener: Callable[[], None] | None = None
        # Called when a request finishes: the load it reports changed (its node agent samples it).
        self.load_listener: Callable[[], None] | None = None
        # Called with the host tier's new state when it is switched (its node agent tells the
        # eviction leader whether this engine takes moves).
        self.host_tier_listener: Callable[[bool], None] | None = None
        self._queued = 0
        self._queued_tokens = 0
        self._running = 0
        # The prefill computing now: when it started and ends (perf_counter), and its computed
        # tokens; none left when none is.
        self._computing: tuple[float, float, int] = _NOT_COMPUTING
        # When the local prefill now running ends (perf_counter); decode steps wait for it.
        self._local_prefill_ends = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        # vLLM's KV-cache events (--kv-events-config); the publisher binds at start().
        source = settings.kv_events_source()
        self.kv_events: KVEventPublisher | None = None
        self._events: KVEventRecorder | None = None
        if settings.kv_events_config.enabled:
            self.kv_events = KVEventPublisher(settings.kv_events_config)
        if self.kv_events is not None and source is not None:
            self._events = KVEventRecorder(source.hasher(), self.kv_events.publish)
            self.pool.on_uncached = self._events.evicted

    @property
    def observer(self) -> EngineObserver:
        """Hears of pulls to check (P) and of handles kept and freed (D)."""
        return self.retention.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self.retention.observer = observer

    # -- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        self.retention.bind(asyncio.get_running_loop())
        self._transport = NixlTransport(f"{self.engine_id}:{self.incarnation[:12]}", self.pool)
        await self.side_channel.start()
        if self.kv_events is not None:
            try:
                self.kv_events.start()  # binds: an endpoint in use fails the start here
            except BaseException:
                await self.stop()
                raise
        self._tasks = [
            asyncio.create_task(self.retention.notification_loop(self._transport), name="simengine-notifs"),
            asyncio.create_task(self.retention.reaper_loop(), name="simengine-reaper"),
        ]

    async def stop(self) -> None:
        await self.retention.stop_spills()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self.side_channel.stop()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)
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
            # Every block a reader may be given: the KV cache's and the host tier's.
            num_blocks=self.pool.addressable_blocks,
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
            queued_prefill_tokens=self._queued_tokens
            + round(tokens_left(time.perf_counter(), *self._computing)),
            running_requests=self._running,
            free_kv_blocks=self.pool.free_blocks,
            total_kv_blocks=self.pool.num_blocks,
            retained_bytes=self.retention.retained_bytes,
            retained_handles=self.retention.count,
            host_total_blocks=self.pool.host_blocks,
            host_free_blocks=self.pool.host_free_blocks,
            host_retained_bytes=self.retention.host_bytes,
            waiting_kv_blocks=self._kv_wanted,
        )

    def adopt_incarnation(self, incarnation: str) -> None:
        """Take the node agent's incarnation; call before the engine serves traffic."""
        self.incarnation = incarnation

    def kv_demand_blocks(self) -> int:
        """Blocks wanted beyond those free and those already being freed. Any thread.

        What waiting requests need, plus the free-block watermark
        (``kv_free_watermark_blocks``), less the free blocks, the blocks of
        release commands taken and not yet carried out (the control plane has
        already answered those) and the blocks of handles being moved to the
        host tier (the engine answers those itself).
        """
        freeing = self.retention.freeing_blocks() + self.retention.spilling_blocks
        wanted = self._kv_wanted + self.settings.kv_free_watermark_blocks
        return max(0, wanted - self.pool.free_blocks - freeing)

    def release_early(self, request_id: str) -> bool:
        return self.retention.release_early(request_id)

    def move_to_host(self, request_id: str) -> str:
        """The control plane's MoveCommand (`Retention.move_to_host`); any thread."""
        return self.retention.move_to_host(request_id)

    def drain(self) -> None:
        self.retention.drain()

    def set_host_tier(self, enabled: bool) -> None:
        """Moves handles to the host tier, or not, from now on (event-loop thread)."""
        self.retention.host_tier_enabled = enabled
        listener = self.host_tier_listener
        _tell(None if listener is None else lambda: listener(enabled), "host tier")

    def set_spill_order(self, device: Sequence[str], host: Sequence[str]) -> None:
        """The control plane's order of moves to the host tier and of drops there; any thread."""
        self.retention.set_spill_order(device, host)

    def retained_handle_ids(self) -> list[str]:
        """Request ids of the decode handles held; from any thread."""
        return self.retention.handle_ids()

    def retained(self) -> list[dict[str, Any]]:
        return self.retention.describe()

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: drop the whole prefix cache (AllBlocksCleared), only while no block is
        in use (a running request or a retained handle); False then. Event-loop thread."""
        if not self.pool.reset_prefix_cache():
            return False
        if self._events is not None:
            self._events.cleared()
        return True

    # -- requests ---------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Run one request, yielding its tokens. Closing the iterator early aborts it."""
        self._require_transport()
        s, bs = self.settings, self.settings.block_size
        leg, retain, remote = self._leg(req)
        run = _Run(list(req.prompt_token_ids), time.perf_counter())
        prompt, n = run.prompt, len(run.prompt)
        self._queued += 1
        run.queued_tokens = n
        self._queued_tokens += n
        try:
            await self._prefill(req, run, leg, remote)
            # The oracle state: the chain of whole blocks, then the tokens after it.
            last_full = run.prompt_chain[-1] if run.prompt_chain else self.pool.root
            tail_start = len(run.prompt_chain) * bs
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
                    run.first_token_at = time.perf_counter()
                    self.metrics.first_token(run.first_token_at - run.t_arrival)
                stop = tok == EOS_ID and not req.ignore_eos
                if stop or len(out) >= req.max_tokens or n + len(out) >= s.max_model_len:
                    finish = self._finish(req, retain, run, out, "stop" if stop else "length")
                    run.blocks = []  # owned by the retained handle, or released
                    run.done = True
                    run.running = False
                    self._running -= 1
                    self._load_changed()
                    self.timeline.record(prompt, run.t_arrival, run.first_token_at, time.perf_counter())
                    yield TokenEvent(tok, finish)
                    return
                yield TokenEvent(tok)
                # The next step computes KV for the token just emitted.
                if n + len(out) > len(run.blocks) * bs:
                    run.blocks += await self._allocate(1)
                await asyncio.sleep(s.timing.decode_s(self._running))
                # A local prefill in the engine's steps holds this decode back until it ends.
                stalled = self._local_prefill_ends - time.perf_counter()
                if stalled > 0:
                    await asyncio.sleep(stalled)
                tok = self._next_token(req, len(out), state)
        finally:
            self._settle(run)

    def _leg(self, req: GenerationRequest) -> tuple[Leg, RetainKind | None, RemoteBlocks | None]:
        """Which leg of a P/D turn the request is, what it keeps at its finish, and whose blocks
        it reads first (after the observer's prefix check on P)."""
        kvp = req.kv_transfer_params or {}
        leg: Leg = "local"
        retain: RetainKind | None = None
        # Routing may find the turn's KV not worth keeping for the next one (kvplane_retain).
        keep = self.bidirectional and kvp.get(KEY_RETAIN) is not False
        if kvp.get("do_remote_prefill"):
            leg = "decode"
            retain = "decode_handle" if keep else None
        elif kvp.get("do_remote_decode"):
            leg, retain = "prefill", "prefill_lease"
        elif kvp:
            # Params naming no remote blocks (D prefilling a turn itself): kept as a D leg's are.
            retain = "decode_handle" if keep else None
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
        return leg, retain, remote

    async def _prefill(
        self, req: GenerationRequest, run: _Run, leg: Leg, remote: RemoteBlocks | None
    ) -> None:
        """The prompt's KV: the prefix cache's, then the remote engine's, then computed in turn."""
        s, bs = self.settings, self.settings.block_size
        prompt, n = run.prompt, len(run.prompt)
        # Keep at least one prompt token to compute: its logits give the first token.
        run.prompt_chain = full_block_hashes(prompt, bs, self.pool.root)
        run.salt = salt_key(req.cache_salt)
        if self._events is not None:
            run.event_blocks = self._events.request(req.cache_salt, req.session_id)
        hit_blocks = self.pool.match_prefix(run.prompt_chain, run.salt) if s.enable_prefix_caching else []
        hit_blocks = hit_blocks[: (n - 1) // bs]
        self.pool.acquire(hit_blocks)
        run.blocks = list(hit_blocks)
        run.hit_blocks = len(hit_blocks)
        hit = len(hit_blocks) * bs
        self._queued_tokens -= hit
        run.queued_tokens -= hit
        run.blocks += await self._allocate(math.ceil(n / bs) - len(run.blocks))
        external = 0
        if leg != "local" and remote is not None:
            # Like vLLM's WAITING_FOR_REMOTE_KVS: the pull runs outside the compute queue.
            with self.tracer.start_as_current_span("kv.pull", attributes={"kvplane.leg": leg}) as span:
                pull_start = time.perf_counter()
                result = await self.remote_loads.load(
                    leg, remote, prompt, run.prompt_chain, run.blocks, run.hit_blocks
                )
                run.pull_ms = (time.perf_counter() - pull_start) * 1000
                span.set_attribute("kvplane.pull.outcome", result.outcome)
                span.set_attribute("kvplane.tokens.pulled", result.external_tokens)
            external = result.external_tokens
            self._queued_tokens -= external
            run.queued_tokens -= external
            self.metrics.load_outcome(leg, result.outcome)
        run.hit, run.external = hit, external
        async with self._prefill_lock:
            self._queued -= 1
            self._queued_tokens -= run.queued_tokens
            run.queued = False
            self._running += 1
            run.running = True
            computed = n - hit - external
            duration = s.timing.prefill_s(computed)
            if leg == "decode" and external and computed <= bs:
                # What D computes after reading P's blocks (the prompt's last token, or a partial
                # block): vLLM runs it in a step of D's batch, not as a prefill of its own.
                duration = s.timing.decode_s(self._running)
            started = time.perf_counter()
            run.queued_ms = max(0.0, (started - run.t_arrival) * 1000 - run.pull_ms)
            if leg == "local":
                self._local_prefill_ends = started + duration
            self._computing = (started, started + duration, computed)
            try:
                await asyncio.sleep(duration)
            finally:
                self._computing = _NOT_COMPUTING
            self._write(run, run.blocks, prompt, n, run.hit_blocks)
            self.metrics.count_prompt(hit, external, computed, alone=leg == "local")
            trace.get_current_span().set_attributes(
                {
                    "kvplane.leg": leg,
                    "kvplane.tokens.prompt": n,
                    "kvplane.tokens.pulled": external,
                    "kvplane.tokens.prefill_cache": hit,
                    "kvplane.tokens.computed": computed,
                }
            )

    def _write(self, run: _Run, blocks: list[int], tokens: list[int], num_tokens: int, first: int) -> None:
        """Write the KV of tokens[:num_tokens] from block `first` on; whole blocks enter the
        prefix cache (and, with KV events on, a BlockStored)."""
        cached: list[int] = []
        self.pool.write_tokens(blocks, tokens, num_tokens, first, run.prompt_chain, run.salt, cached)
        if self._events is not None and run.event_blocks is not None:
            self._events.stored(run.event_blocks, tokens, blocks, cached)

    def _settle(self, run: _Run) -> None:
        """The request's end: reached with blocks still owned only on abort or error (they are
        freed, and nothing is returned)."""
        if run.queued:
            self._queued -= 1
            self._queued_tokens -= run.queued_tokens
        if run.running:
            self._running -= 1
            self._load_changed()
        if run.blocks:
            self.pool.release(run.blocks)
            self.retention.blocks_freed.set()
        if not run.done:
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
        start = time.perf_counter()
        deadline = start + self.settings.kv_wait_timeout_s
        waiting = False
        freed = self.retention.blocks_freed
        try:
            while True:
                try:
                    return self.pool.allocate(count)
                except KvCacheFullError:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise
                    first = not waiting
                    if first:
                        waiting = True
                        self._kv_wanted += count
                        # What holds the memory when the wait starts: running requests, or handles
                        # kept for later turns.
                        held_by = (
                            self._running,
                            self.pool.free_blocks,
                            self._retained_blocks(),
                            self.retention.count,
                        )
                    # Cleared before anything that may free blocks: a move to a whole copy ahead
                    # frees them within `spill`, and that wake-up must not be lost.
                    freed.clear()
                    # The host tier first: only what it cannot make room for is asked of the
                    # control plane (kv_demand_blocks counts the blocks on their way).
                    self.retention.spill(self._kv_wanted - self.pool.free_blocks)
                    if first:
                        self._demand_changed()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await freed.wait()
        finally:
            if waiting:
                waited = time.perf_counter() - start
                self.metrics.kv_waited(waited)
                log.info(
                    "a request waited %.3f s for %d KV blocks; when it began: %d running, %d blocks "
                    "free, %d held by %d retained handles and leases",
                    waited,
                    count,
                    *held_by,
                )
                self._kv_wanted -= count
                self._demand_changed()

    def _retained_blocks(self) -> int:
        """Blocks of the KV cache that retained handles and leases hold."""
        return self.retention.retained_bytes // self.settings.bytes_per_block

    def _load_changed(self) -> None:
        _tell(self.load_listener, "load")

    def _demand_changed(self) -> None:
        _tell(self.demand_listener, "demand")

    def _finish(
        self,
        req: GenerationRequest,
        retain: RetainKind | None,
        run: _Run,
        out: list[int],
        reason: Literal["stop", "length"],
    ) -> FinishInfo:
        bs = self.settings.block_size
        prompt = run.prompt
        all_tokens = prompt + out
        # The last token was sampled but never fed back, so it has no KV.
        num_kv = len(all_tokens) - 1
        keep = math.ceil(num_kv / bs)
        blocks = run.blocks
        if blocks[keep:]:
            self.pool.release(blocks[keep:])
        blocks = blocks[:keep]
        self._write(run, blocks, all_tokens, num_kv, min(len(prompt) // bs, keep))
        self.metrics.finished(reason, len(out))
        params = self.retention.keep(
            req.request_id,
            retain,
            blocks,
            num_kv,
            all_tokens,
            run.external,
            req.kv_transfer_params or {},
            pull_ms=run.pull_ms,
            queued_ms=run.queued_ms,
        )
        return FinishInfo(reason, tuple(out), run.hit + run.external, params, run.external)


def _tell(listener: Callable[[], None] | None, what: str) -> None:
    """Calls an engine listener; a listener that fails is logged, never the engine's failure."""
    if listener is not None:
        try:
            listener()
        except Exception:
            log.exception("%s listener failed", what)
