"""The simulated fleet: node identities (domain `Node`s) and their changing state.

State classes are mutable on purpose: the event loop updates them millions of
times, and the policies never see them, only the frozen snapshots built from
them (`NodeLoad`, `CacheHandle`, `HandleInfo`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvplane.bench.sim.block_chain import BlockChain
from kvplane.bench.sim.cache_events import CacheEventFeed
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole, tokens_left
from kvplane.services.eviction.policy import HandleInfo

# vLLM's default KV block size; node free/total KV is reported in these blocks.
ENGINE_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The fleet: node counts, each node's KV capacity (bytes), D's TTL (s)."""

    prefill_nodes: int = 8
    decode_nodes: int = 8
    # KV capacity of one decode node: two 80 GB accelerators (TP=2) after Qwen3-32B's
    # 64 GB of bf16 weights and activations leave about 80 GiB.
    decode_kv_capacity_bytes: int = 80 << 30
    # vLLM's decoder_kv_blocks_ttl: D frees an unread handle this long after its turn.
    engine_ttl_s: float = 480.0
    # KV a prefill node keeps as its prefix cache (vLLM's enable_prefix_caching): the same
    # accelerators as D, less what the prefill batch in flight takes. 0: no prefix cache.
    prefill_cache_bytes: int = 64 << 30
    # KV pool a prefill engine registers (its accelerators after the weights), which is all a
    # router is told: what its prefix cache really keeps of it (above), a router learns only
    # from P's reports. With the prefix cache off the engine still registers its pool.
    prefill_kv_capacity_bytes: int = 80 << 30
    model: str = "Qwen/Qwen3-32B"
    zones: int = 1
    # Host memory of one decode node for KV (the tiered engine model; 0: no host tier). With
    # kvplane's control plane, D keeps its retained handles there (`engine.py`).
    decode_host_bytes: int = 0
    # Every finished turn's KV (prompt and output) is offloaded to D's host tier, an LRU of
    # blocks that any P may read by block hash (llm-d's P/D + P2P path); D's accelerators keep
    # nothing of it. False: the host tier holds the handles D keeps there (`engine.py`).
    decode_offload_all: bool = False
    # kvplane's D copies each handle to its host tier as it publishes it (off every turn's path),
    # keeps it on its accelerators, and moves it to the copy at once when its blocks are wanted,
    # as the sim-engine (`host_copy_ahead`) and vLLM's OffloadingConnector (which stores blocks
    # as they fill) do. False: the copy starts only when the blocks are wanted, and they wait for it.
    decode_copy_ahead: bool = True
    # A what-if: kvplane's D copies each handle to its host tier as it publishes it, and frees
    # the accelerator blocks once the copy is whole, so that a demand finds them already free.
    # No engine does this: they keep the handle on their accelerators until its blocks are wanted.
    decode_write_through: bool = False
    # How long after its publish a handle in D's host memory stays offered (s): D's TTL holds
    # accelerator blocks for a read; host memory is cheap enough to keep a conversation for its
    # longer gaps, and its own size bounds it (the oldest entries go first).
    decode_host_ttl_s: float = 3600.0
    # Each D keeps a prefix cache of its finished turns' blocks (prompt and output) in the
    # accelerator memory its running turns leave free, least recently used out first, as vLLM's
    # prefix cache or SGLang's decode-side radix cache does; nothing in it is pinned. A turn
    # whose prompt starts with blocks D holds receives only the rest from P.
    decode_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1 or self.decode_kv_capacity_bytes <= 0:
            raise ValueError("need at least one P and one D node with positive KV capacity")
        if self.prefill_cache_bytes < 0 or self.prefill_kv_capacity_bytes < 0:
            raise ValueError("prefill_cache_bytes and prefill_kv_capacity_bytes must be >= 0")
        if self.decode_host_bytes < 0:
            raise ValueError("decode_host_bytes must be >= 0")
        if self.decode_offload_all and self.decode_host_bytes <= 0:
            raise ValueError("decode_offload_all needs a host tier (decode_host_bytes > 0)")
        if self.decode_write_through and self.decode_host_bytes <= 0:
            raise ValueError("decode_write_through needs a host tier (decode_host_bytes > 0)")


def build_node(role: NodeRole, index: int, spec: ClusterSpec, kv_bytes_per_token: int) -> Node:
    prefix = "p" if role is NodeRole.PREFILL else "d"
    return Node(
        node_id=f"{prefix}{index}",
        incarnation="1",
        role=role,
        engine_id=f"engine-{prefix}{index}",
        http_url=f"http://{prefix}{index}:8000",
        side_channel_host=f"{prefix}{index}",
        side_channel_port=5600,
        fingerprint=Fingerprint(spec.model, "bfloat16"),
        block_size=ENGINE_BLOCK_TOKENS,
        # A prefill engine registers its KV pool too, which its prefix cache lives in: a router
        # bounds what it believes the node still caches by it.
        kv_capacity_bytes=(
            spec.decode_kv_capacity_bytes
            if role is NodeRole.DECODE
            else max(spec.prefill_kv_capacity_bytes, spec.prefill_cache_bytes)
        ),
        kv_bytes_per_token=kv_bytes_per_token,
        labels={"zone": f"z{index % max(1, spec.zones)}"},
    )


class PrefillState:
    """A prefill node: its scheduler's queues, one compute stream, and its prefix cache.

    Ground truth: routers that model a live router read only its load
    reports (see `fleet.py`). The event loop (`engine.py`) moves turns
    through it: `waiting` (FIFO, not yet taken by the scheduler), reads in
    flight, `ready` (read landed, scheduled before anything waiting), then
    one compute at a time.
    """

    __slots__ = (
        "_tick",
        "_tick_epoch",
        "backlog_s",
        "busy",
        "cache",
        "feed",
        "free_at",
        "index",
        "jobs",
        "node",
        "queued_tokens",
        "reading",
        "ready",
        "report_interval_s",
        "run",
        "served",
        "waiting",
    )

    def __init__(self, node: Node, index: int, cache_blocks: int = 0, report_interval_s: float = 0.0) -> None:
        self.node = node
        self.index = index
        self.cache = PrefixCache(cache_blocks)
        # What this engine's KV events deliver to a router (None: the router reads none).
        self.feed: CacheEventFeed | None = None
        # Turns routed here and not yet taken by the scheduler, in arrival order.
        self.waiting: deque[Any] = deque()
        # Turns whose read has landed, in landing order: scheduled first, as vLLM drains
        # requests that already hold KV blocks before new ones.
        self.ready: deque[Any] = deque()
        self.reading = 0  # reads in flight (vLLM's WAITING_FOR_REMOTE_KVS)
        self.busy = False  # computing a prompt
        self.free_at = 0.0  # when the prompt being computed is done
        # The prompt being computed: its computed tokens, when it started and when it ends.
        self.run: tuple[int, float, float] = (0, 0.0, 0.0)
        # Turns here, from routing to the end of their prefill, and the tokens they compute.
        self.jobs = 0
        self.queued_tokens = 0
        # Estimated compute seconds of the turns not yet computing (the oracle's view).
        self.backlog_s = 0.0
        self.served = 0
        # The load at the latest report tick, kept when the first change after it happens.
        self.report_interval_s = report_interval_s
        self._tick: tuple[int, int, bool, tuple[int, float, float]] = (0, 0, False, (0, 0.0, 0.0))
        self._tick_epoch = -1

    def changing(self, now: float) -> None:
        """Called before `jobs`, `queued_tokens` or `busy` change at `now`.

        The first change after a report tick sees the load as it was at the
        tick; `load` reports that, so a report holds only what the node had
        at its stamp, whenever a router first reads it.
        """
        if self.report_interval_s > 0:
            epoch = int(now / self.report_interval_s)
            if epoch != self._tick_epoch:
                self._tick = (self.jobs, self.queued_tokens, self.busy, self.run)
                self._tick_epoch = epoch

    def finish_after_s(self, now: float) -> float:
        """When P would be done with everything it holds now, in its scheduler's order (exact)."""
        return max(now, self.free_at if self.busy else now) + self.backlog_s

    def load(self, report_s: float, report_ms: int) -> NodeLoad:
        """The load at the report tick `report_s` (the latest tick before now)."""
        jobs, tokens, busy, run = self.jobs, self.queued_tokens, self.busy, self.run
        if self.report_interval_s > 0 and round(report_s / self.report_interval_s) == self._tick_epoch:
            jobs, tokens, busy, run = self._tick
        if busy:
            # As the sim-engine reports it: the prompt computing at the tick counts for what it
            # has not computed yet then.
            computing, start, end = run
            tokens -= computing - round(tokens_left(report_s, start, end, computing))
        running = 1 if busy else 0
        return NodeLoad(
            self.node.node_id,
            self.node.incarnation,
            queued_requests=max(0, jobs - running),
            queued_prefill_tokens=tokens,
            running_requests=running,
            reported_unix_ms=report_ms,
        )


class SimHandle:
    """One retained handle on a decode node."""

    __slots__ = (
        "alive",
        "bytes",
        "cache_handle",
        "chain",
        "checked_out",
        "conversation",
        "copied_s",
        "decode",
        "expiry_s",
        "handle_id",
        "info",
        "poisoned_from",
        "published_s",
        "reading",
        "tenant",
        "tier",
        "tokens",
    )

    def __init__(
        self,
        handle_id: int,
        tenant: str,
        conversation: str,
        decode: DecodeState,
        tokens: int,
        nbytes: int,
        chain: BlockChain,
        published_s: float,
        expiry_s: float,
    ) -> None:
        self.handle_id = handle_id
        self.tenant = tenant
        self.conversation = conversation
        self.decode = decode
        self.tokens = tokens
        self.bytes = nbytes
        self.chain = chain
        self.published_s = published_s
        self.expiry_s = expiry_s
        self.alive = True
        # Routed to a pull: no other route gets it, and no control-plane release frees it (the
        # fenced check-out); D's blocks stay until P has read them, or D's TTL or pressure ends them.
        self.checked_out = False
        self.reading = False  # P's read of its blocks is in flight
        # Where its KV is: "gpu" (D's accelerators), "spilling" (being copied to D's host memory,
        # still readable from the accelerators) or "host" (D's host memory only).
        self.tier = "gpu"
        # When D's copy ahead of it in host memory is whole (`ClusterSpec.decode_copy_ahead`;
        # infinite: no copy ahead).
        self.copied_s = float("inf")
        # The first block of its context whose KV is wrong (built on a wrong-prefix pull), if any.
        self.poisoned_from: int | None = None
        # Built on first use: most handles are never routed to or judged.
        self.cache_handle: CacheHandle | None = None
        self.info: HandleInfo | None = None


class DecodeState:
    """A decode node: running requests' KV plus retained handles, within a capacity."""

    __slots__ = (
        "capacity",
        "copies",
        "feed",
        "handles",
        "host_cache",
        "host_capacity",
        "host_copies",
        "host_handles",
        "host_retained",
        "index",
        "local_free_at",
        "node",
        "prefix_cache",
        "reserved",
        "retained",
        "running",
        "spilling",
        "stalled_s",
        "waiting",
    )

    def __init__(self, node: Node, index: int, capacity: int, host_capacity: int = 0) -> None:
        self.node = node
        self.index = index
        self.capacity = capacity
        self.reserved = 0  # bytes of running requests
        self.retained = 0  # bytes of retained handles on the accelerators (spilling ones included)
        self.running = 0
        # Retained handles by id, in publish order (oldest first), whatever their tier.
        self.handles: dict[int, SimHandle] = {}
        # Turns waiting for KV to be freed, in arrival order (when D pins retained KV).
        self.waiting: deque[Any] = deque()
        # The host tier: its capacity, the bytes of the handle copies it holds (or is being
        # written), and those handles in the order they came (the first goes first when full).
        self.host_capacity = host_capacity
        self.host_retained = 0
        self.host_handles: dict[int, SimHandle] = {}
        # Copies ahead of handles still on the accelerators (`ClusterSpec.decode_copy_ahead`):
        # their bytes in host memory, and the handles, oldest first (the first given back).
        self.host_copies = 0
        self.copies: dict[int, SimHandle] = {}
        # Bytes whose copy to the host tier is in flight: freed on the accelerators once done.
        self.spilling = 0
        # With `ClusterSpec.decode_offload_all`: the offloaded blocks, an LRU by block hash.
        self.host_cache: PrefixCache | None = None
        # With `ClusterSpec.decode_prefix_cache`: finished turns' blocks in the memory left free,
        # and the handles' blocks, pinned there until the handle frees them.
        self.prefix_cache: PrefixCache | None = None
        # Where the prefix cache's changes go as D's KV events, when a router reads them.
        self.feed: CacheEventFeed | None = None
        # When D's compute is next free for a prompt it prefills itself (conditional
        # disaggregation), in simulated seconds.
        self.local_free_at = 0.0
        # Seconds of prefill D has run on its own compute so far: each stalled its running decodes.
        self.stalled_s = 0.0

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.retained

    def fit_prefix_cache(self, block_bytes: int) -> None:
        """D's prefix cache gets what its running turns and retained handles leave free."""
        if self.prefix_cache is not None:
            self.prefix_cache.resize(max(0, self.free) // block_bytes)

    def load(self, now_ms: int, kv_bytes_per_token: int) -> NodeLoad:
        block = ENGINE_BLOCK_TOKENS * kv_bytes_per_token
        return NodeLoad(
            self.node.node_id,
            self.node.incarnation,
            running_requests=self.running,
            queued_requests=len(self.waiting),
            free_kv_blocks=max(0, self.free) // block,
            total_kv_blocks=self.capacity // block,
            retained_bytes=self.retained,
            reported_unix_ms=now_ms,
            # As live engines report it: what the turns waiting for memory need.
            waiting_kv_blocks=sum(f.reserved for f in self.waiting) // block,
        )
