"""Who releases retained handles early, for each baseline.

`PipelineRetention` is kvplane's eviction coordinator without its I/O: the
same `RetentionPipeline` and `TurnTracker` objects, fed the handles the
fleet publishes, evaluated every `interval_s` of simulated time (the service
evaluates on every change and at least each second; a coarser interval only
delays releases). It also releases a conversation's previous handle when a
new one is published, as the metadata service does. `EngineOnly` is a fleet
with no control plane: handles live until D's TTL frees them, or D needs
the memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvplane.bench.sim.cluster import SimHandle
from kvplane.bench.sim.fleet import Fleet
from kvplane.services.eviction.policy import (
    HandleInfo,
    NodeInfo,
    RetentionPipeline,
    Snapshot,
    TurnTracker,
)


class Retention(Protocol):
    # Whether publishing a conversation's new handle releases its previous one.
    releases_superseded: bool
    # Seconds between evaluations (0: never evaluated).
    interval_s: float

    def on_publish(self, handle: SimHandle) -> None: ...

    def on_gone(self, handle: SimHandle) -> None: ...

    def evaluate(self, now: float) -> list[tuple[int, str]]:
        """(handle id, reason) of each handle to release now."""
        ...


class EngineOnly:
    releases_superseded = False
    interval_s = 0.0

    def on_publish(self, handle: SimHandle) -> None:
        return None

    def on_gone(self, handle: SimHandle) -> None:
        return None

    def evaluate(self, now: float) -> list[tuple[int, str]]:
        return []


class PipelineRetention:
    releases_superseded = True

    def __init__(self, fleet: Fleet, config: Mapping[str, Any] | None, interval_s: float = 1.0) -> None:
        self.fleet = fleet
        self.pipeline = RetentionPipeline.from_config(config)
        self.tracker = TurnTracker(self.pipeline.values.gaps)
        self.interval_s = interval_s
        self._infos: dict[int, HandleInfo] = {}

    def on_publish(self, handle: SimHandle) -> None:
        fleet = self.fleet
        published = fleet.unix_ms(handle.published_s)
        info = HandleInfo(
            handle.tenant,
            handle.conversation,
            str(handle.handle_id),
            handle.decode.node.node_id,
            handle.bytes,
            handle.tokens,
            published,
            fleet.unix_ms(handle.expiry_s),
        )
        handle.info = info
        self._infos[handle.handle_id] = info
        self.tracker.on_publish(handle.tenant, handle.conversation, published)

    def on_gone(self, handle: SimHandle) -> None:
        self._infos.pop(handle.handle_id, None)

    def evaluate(self, now: float) -> list[tuple[int, str]]:
        now_ms = self.fleet.unix_ms(now)
        self.tracker.expire(now_ms)
        if not self._infos:
            return []
        # What the coordinator knows of each holder: its capacity and its latest load report.
        nodes = {
            d.node.node_id: NodeInfo(
                d.node.node_id,
                d.capacity,
                reported_retained_bytes=d.retained,
                free_kv_fraction=max(0, d.free) / d.capacity,
            )
            for d in self.fleet.decode
        }
        releases = self.pipeline.evaluate(Snapshot(now_ms, tuple(self._infos.values()), nodes))
        # Labelled by the policy that chose them: kv_pressure and node_budget share a reason.
        return [(int(r.handle_id), r.policy) for r in releases]
