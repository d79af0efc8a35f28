"""The values retention policies judge: a snapshot in, releases out.

Plain frozen dataclasses with no dependency on etcd, gRPC or the clock, so
the discrete-event simulator can build them directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from kvplane.services.common.model.handles import ReleaseReason


@dataclass(frozen=True, slots=True)
class HandleInfo:
    """One retained handle as a policy sees it. Times are Unix milliseconds."""

    tenant: str
    conversation: str
    handle_id: str
    node_id: str
    retained_bytes: int
    num_tokens: int
    published_unix_ms: int
    wall_expiry_unix_ms: int
    # In the engine's KV cache (False: in its host memory, which device shortages do not touch).
    on_device: bool = True

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation)

    def age_s(self, now_unix_ms: int) -> float:
        return max(0, now_unix_ms - self.published_unix_ms) / 1000.0

    def life_left_s(self, now_unix_ms: int) -> float:
        return max(0, self.wall_expiry_unix_ms - now_unix_ms) / 1000.0


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A holder node. Zero means the node did not say.

    `reported_retained_bytes` is the node's own count of pinned KV (its load
    report): it can exceed the published handles' sum, for example while a
    finished turn's handle is still on its way. `free_kv_fraction` is the
    share of its KV blocks free at the last report (1.0: unknown).
    `demand_bytes` is KV the node's waiting requests need now and that no
    release already on its way to the node covers (0: no demand).
    """

    node_id: str
    kv_capacity_bytes: int = 0
    reported_retained_bytes: int = 0
    free_kv_fraction: float = 1.0
    demand_bytes: int = 0


def _frozen_nodes(nodes: Mapping[str, NodeInfo]) -> Mapping[str, NodeInfo]:
    return MappingProxyType(dict(nodes))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a policy may look at, taken at `now_unix_ms`."""

    now_unix_ms: int
    handles: tuple[HandleInfo, ...]
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", _frozen_nodes(self.nodes))

    def on_device(self) -> Snapshot:
        """The snapshot of the handles in engines' KV caches only: those the policies judge. A
        handle in a host tier leaves it when its time there ends, when the tier is full (in the
        leader's spill order) or when its conversation moves on."""
        return Snapshot(self.now_unix_ms, tuple(h for h in self.handles if h.on_device), self.nodes)

    def without(self, released: Mapping[tuple[str, str], object]) -> Snapshot:
        """The snapshot less the handles already chosen for release.

        Their bytes count toward their nodes' demand: memory freed for any
        reason answers it.
        """
        kept: list[HandleInfo] = []
        freed: dict[str, int] = {}
        for h in self.handles:
            if h.key in released:
                if h.on_device:
                    freed[h.node_id] = freed.get(h.node_id, 0) + h.retained_bytes
            else:
                kept.append(h)
        nodes = dict(self.nodes)
        for node_id, nbytes in freed.items():
            node = nodes.get(node_id)
            if node is not None and node.demand_bytes > 0:
                nodes[node_id] = replace(node, demand_bytes=max(0, node.demand_bytes - nbytes))
        return Snapshot(self.now_unix_ms, tuple(kept), nodes)


@dataclass(frozen=True, slots=True)
class Release:
    """A decision to release one handle, and why.

    `reason` becomes the metric label and span attribute; `detail` is the
    human half of the log line ("node d1 at 9.1 GB over 8.0 GB high mark").
    """

    tenant: str
    conversation: str
    handle_id: str
    node_id: str
    reason: ReleaseReason
    policy: str
    detail: str = ""
    retained_bytes: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.conversation)

    @classmethod
    def of(cls, handle: HandleInfo, reason: ReleaseReason, policy: str, detail: str = "") -> Release:
        return cls(
            handle.tenant,
            handle.conversation,
            handle.handle_id,
            handle.node_id,
            reason,
            policy,
            detail,
            handle.retained_bytes,
        )
