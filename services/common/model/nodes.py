"""Engines as the control plane sees them: identity, layout and load."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class NodeRole(enum.Enum):
    """The part an engine plays in disaggregated serving."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def can_prefill(self) -> bool:
        return self in (NodeRole.PREFILL, NodeRole.BOTH)

    def can_decode(self) -> bool:
        return self in (NodeRole.DECODE, NodeRole.BOTH)


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must match for KV to move between two engines."""

    model: str
    kv_dtype: str = ""
    kv_layout: str = ""
    extra: str = ""


def _frozen_labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(labels))


@dataclass(frozen=True, slots=True)
class Node:
    """A registered engine. `incarnation` is new at every engine start."""

    node_id: str
    incarnation: str
    role: NodeRole
    engine_id: str
    http_url: str
    side_channel_host: str
    side_channel_port: int
    fingerprint: Fingerprint
    block_size: int
    kv_capacity_bytes: int = 0
    kv_bytes_per_token: int = 0
    dp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    labels: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False
    registered_unix_ms: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _frozen_labels(self.labels))

    def __hash__(self) -> int:
        return hash((self.node_id, self.incarnation))


def tokens_left(now: float, start: float, end: float, tokens: int) -> float:
    """Of `tokens` computed evenly from `start` to `end`, those not computed yet at `now`: how a
    prefill that is computing counts in its engine's `NodeLoad.queued_prefill_tokens`, and in a
    router's estimate of a queue."""
    if end <= now:
        return 0.0
    if start >= now or end <= start:
        return float(tokens)
    return tokens * (end - now) / (end - start)


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """A node's load report. Counts are instantaneous; bytes are bytes."""

    node_id: str
    incarnation: str
    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    retained_bytes: int = 0
    reported_unix_ms: int = 0
    # Blocks that requests waiting for memory need beyond what they hold.
    waiting_kv_blocks: int = 0

    @property
    def free_kv_fraction(self) -> float:
        """Free share of the KV cache, 1.0 when the node did not say."""
        if self.total_kv_blocks <= 0:
            return 1.0
        return self.free_kv_blocks / self.total_kv_blocks

    @property
    def open_kv_blocks(self) -> int:
        """Free blocks a new request could have: the engine admits it after the requests already
        waiting for memory, so their need comes first."""
        return max(0, self.free_kv_blocks - self.waiting_kv_blocks)

    @property
    def open_kv_fraction(self) -> float:
        """`open_kv_blocks` as a share of the KV cache, 1.0 when the node did not say."""
        if self.total_kv_blocks <= 0:
            return 1.0
        return self.open_kv_blocks / self.total_kv_blocks
