"""What keeping a handle is worth, against what holding its memory costs.

Both sides are in GPU-seconds:

- benefit = P(next turn arrives before the handle's deadline) x the prefill
  time a pull saves (the handle's tokens at `prefill_tokens_per_s`);
- cost = the share of the holder's KV capacity the handle pins x the seconds
  it would stay pinned (until its deadline) x `holding_cost` (GPU-seconds
  that a whole node's KV capacity held idle for one second is worth).

Budget policies release the lowest `density` (benefit per unit of cost)
first; the low-value policy releases what costs more than it is worth.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.eviction.policy.gaps import GapStatistics
from kvplane.services.eviction.policy.model import HandleInfo, Snapshot


@dataclass(frozen=True, slots=True)
class ValueParams:
    # Prefill speed used to price a recompute, in tokens per second.
    prefill_tokens_per_s: float = 8000.0
    # GPU-seconds that one node's whole KV capacity, held idle for one second,
    # is worth. Small: idle memory only costs what it displaces.
    holding_cost: float = 0.01
    # Capacity assumed for nodes that did not report one, in bytes.
    default_capacity_bytes: int = 64 << 30

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.holding_cost < 0 or self.default_capacity_bytes <= 0:
            raise ValueError("value parameters must be positive")


@dataclass(frozen=True, slots=True)
class Valuation:
    """One handle's worth at one instant."""

    p_return: float
    benefit_s: float
    cost_s: float

    @property
    def density(self) -> float:
        """Benefit per unit of cost; larger is worth keeping more."""
        return self.benefit_s / self.cost_s if self.cost_s > 0 else float("inf")


class ValueModel:
    """Values handles from gap statistics; deterministic for given statistics."""

    def __init__(self, gaps: GapStatistics | None = None, params: ValueParams | None = None) -> None:
        self.gaps = gaps or GapStatistics()
        self.params = params or ValueParams()

    def recompute_s(self, handle: HandleInfo) -> float:
        return handle.num_tokens / self.params.prefill_tokens_per_s

    def value(self, handle: HandleInfo, snapshot: Snapshot) -> Valuation:
        now = snapshot.now_unix_ms
        node = snapshot.nodes.get(handle.node_id)
        capacity = node.kv_capacity_bytes if node is not None and node.kv_capacity_bytes > 0 else 0
        capacity = capacity or self.params.default_capacity_bytes
        life_left = handle.life_left_s(now)
        p = self.gaps.p_next_turn_within(handle.tenant, handle.age_s(now), life_left)
        benefit = p * self.recompute_s(handle)
        cost = handle.retained_bytes / capacity * life_left * self.params.holding_cost
        return Valuation(p, benefit, cost)

    def reuse_per_byte(self, handle: HandleInfo, snapshot: Snapshot) -> float:
        """Expected prefill seconds a pull of `handle` saves, per byte it holds."""
        return self.value(handle, snapshot).benefit_s / max(1, handle.retained_bytes)

    def least_reuse_per_byte_first(self, handles: list[HandleInfo], snapshot: Snapshot) -> list[HandleInfo]:
        """`handles` in on-demand release order: least expected reuse per byte first; ties: oldest.

        Unlike `lowest_value_first`, holding time does not enter: memory wanted
        now is wanted whatever each handle's remaining life.
        """
        return sorted(
            handles,
            key=lambda h: (self.reuse_per_byte(h, snapshot), h.published_unix_ms, h.tenant, h.conversation),
        )

    def lowest_value_first(self, handles: list[HandleInfo], snapshot: Snapshot) -> list[HandleInfo]:
        """`handles` in release order: lowest density first; ties: oldest, then key."""
        return sorted(
            handles,
            key=lambda h: (self.value(h, snapshot).density, h.published_unix_ms, h.tenant, h.conversation),
        )
