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
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.services.common.handles import CacheHandle
from kvplane.services.common.nodes import Fingerprint, Node, NodeLoad, NodeRole
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
    model: str = "Qwen/Qwen3-32B"
    zones: int = 1

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1 or self.decode_kv_capacity_bytes <= 0:
            raise ValueError("need at least one P and one D node with positive KV capacity")
        if self.prefill_cache_bytes < 0:
            raise ValueError("prefill_cache_bytes must be >= 0")


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
            spec.decode_kv_capacity_bytes if role is NodeRole.DECODE else spec.prefill_cache_bytes
        ),
        kv_bytes_per_token=kv_bytes_per_token,
        labels={"zone": f"z{index % max(1, spec.zones)}"},
    )


class PrefillState:
    """A prefill node: one FIFO compute queue and its prefix cache."""

    __slots__ = ("cache", "free_at", "index", "node", "pending", "queued_tokens", "served")

    def __init__(self, node: Node, index: int, cache_blocks: int = 0) -> None:
        self.node = node
        self.index = index
        # Ground truth: routers that model a live router must not read it (see `fleet.py`).
        self.cache = PrefixCache(cache_blocks)
        self.free_at = 0.0
        # (finish time, computed tokens) of work not yet finished, in finish order.
        self.pending: deque[tuple[float, int]] = deque()
        self.queued_tokens = 0
        self.served = 0

    def settle(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= now:
            self.queued_tokens -= pending.popleft()[1]

    def load(self, now: float, now_ms: int) -> NodeLoad:
        self.settle(now)
        n = len(self.pending)
        return NodeLoad(
            self.node.node_id,
            self.node.incarnation,
            queued_requests=max(0, n - 1),
            queued_prefill_tokens=self.queued_tokens,
            running_requests=min(1, n),
            reported_unix_ms=now_ms,
        )


class SimHandle:
    """One retained handle on a decode node."""

    __slots__ = (
        "alive",
        "bytes",
        "cache_handle",
        "chain",
        "conversation",
        "decode",
        "expiry_s",
        "handle_id",
        "info",
        "published_s",
        "tenant",
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
        # Built on first use: most handles are never routed to or judged.
        self.cache_handle: CacheHandle | None = None
        self.info: HandleInfo | None = None


class DecodeState:
    """A decode node: running requests' KV plus retained handles, within a capacity."""

    __slots__ = ("capacity", "handles", "index", "node", "reserved", "retained", "running", "waiting")

    def __init__(self, node: Node, index: int, capacity: int) -> None:
        self.node = node
        self.index = index
        self.capacity = capacity
        self.reserved = 0  # bytes of running requests
        self.retained = 0  # bytes of retained handles
        self.running = 0
        # Retained handles by id, in publish order (oldest first).
        self.handles: dict[int, SimHandle] = {}
        # Turns waiting for KV to be freed, in arrival order (when D pins retained KV).
        self.waiting: deque[Any] = deque()

    @property
    def free(self) -> int:
        return self.capacity - self.reserved - self.retained

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
        )
