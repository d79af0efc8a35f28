"""Who releases retained handles early, for each baseline.

`PipelineRetention` is kvplane's eviction coordinator without its I/O: the
same `RetentionPipeline` and `TurnTracker` objects, fed the handles the
fleet publishes, evaluated every `interval_s` of simulated time (the service
evaluates on every change and at least each second; a coarser interval only
delays releases). It also releases a conversation's previous handle when a
new one is published, as the metadata service does, and answers a decode
node's KV demand: when turns wait on D for memory, the simulator asks
`answer_demand` after `demand_latency_s`, and the pipeline's `demand` plugin
(`RetentionPipeline.for_demand`, the coordinator's own entry point) picks
that node's handles to release. `EngineOnly` is a fleet with no control
plane: handles live until D's TTL frees them, or D needs the memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kvplane.bench.sim.cluster import DecodeState, SimHandle
from kvplane.bench.sim.fleet import Fleet
from kvplane.services.eviction.policy import (
    HandleInfo,
    NodeInfo,
    RetentionPipeline,
    Snapshot,
    TurnTracker,
)

# Seconds from a decode engine's KV demand to its freed blocks through kvplane, as measured: the p50
# wait of a request on a full decode sim-engine (its node agent's demand on the command stream,
# the leader's fenced etcd transaction and release command, the engine's scheduler steps that free
# the blocks) against the same request with memory free, by
# `python -m kvplane.bench.demand_bench --rounds 20 --blocks 64 --speedup 1 --json
# bench/results/demand_bench.json` (the sim-engine at the simulated model's timing; p90 16.7 ms).
# No bench has measured it on vLLM's connector yet.
MEASURED_DEMAND_LATENCY_S = 0.0043
DEMAND_LATENCY_SOURCE = "bench/results/demand_bench.json"
DEFAULT_DEMAND_LATENCY_S = MEASURED_DEMAND_LATENCY_S


class Retention(Protocol):
    # Whether publishing a conversation's new handle releases its previous one.
    releases_superseded: bool
    # Seconds between evaluations (0: never evaluated).
    interval_s: float
    # Seconds from a node's KV demand to the release that answers it (None: nothing answers).
    demand_latency_s: float | None
    # Whether a decode node with host memory keeps this control plane's handles there.
    spills: bool

    def on_publish(self, handle: SimHandle) -> None: ...

    def on_gone(self, handle: SimHandle) -> None: ...

    def evaluate(self, now: float) -> list[tuple[int, str]]:
        """(handle id, reason) of each handle to release now."""
        ...

    def answer_demand(self, decode: DecodeState, now: float) -> list[tuple[int, str]]:
        """(handle id, reason) of each handle to release for the turns waiting on `decode`."""
        ...

    def host_drop_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        """`handles`, in a decode node's host memory, in the order a full host tier drops them."""
        ...

    def device_spill_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        """`handles`, on a decode node's accelerators, in the order a short node moves them to
        its host memory."""
        ...


class EngineOnly:
    releases_superseded = False
    spills = False
    interval_s = 0.0
    demand_latency_s: float | None = None

    def on_publish(self, handle: SimHandle) -> None:
        return None

    def on_gone(self, handle: SimHandle) -> None:
        return None

    def evaluate(self, now: float) -> list[tuple[int, str]]:
        return []

    def host_drop_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        return list(handles)  # oldest first: no one values them

    def device_spill_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        return list(handles)  # oldest first: no one values them

    def answer_demand(self, decode: DecodeState, now: float) -> list[tuple[int, str]]:
        return []


class PipelineRetention:
    releases_superseded = True
    spills = True

    def __init__(
        self,
        fleet: Fleet,
        config: Mapping[str, Any] | None,
        interval_s: float = 1.0,
        demand_latency_s: float = DEFAULT_DEMAND_LATENCY_S,
    ) -> None:
        self.fleet = fleet
        self.pipeline = RetentionPipeline.from_config(config)
        self.tracker = TurnTracker(self.pipeline.values.gaps)
        self.interval_s = interval_s
        # A pipeline without the demand plugin does not answer demand.
        self.demand_latency_s = demand_latency_s if self.pipeline.on_demand is not None else None
        self._infos: dict[int, HandleInfo] = {}
        # The same, by holder node: a demand looks at one node's handles.
        self._by_node: dict[str, dict[int, HandleInfo]] = {}

    def _info(self, handle: SimHandle, on_device: bool = True) -> HandleInfo:
        """The handle as the coordinator sees it now (its expiry as it stands)."""
        fleet = self.fleet
        return HandleInfo(
            handle.tenant,
            handle.conversation,
            str(handle.handle_id),
            handle.decode.node.node_id,
            handle.bytes,
            handle.tokens,
            fleet.unix_ms(handle.published_s),
            fleet.unix_ms(handle.expiry_s),
            on_device=on_device,
        )

    def on_publish(self, handle: SimHandle) -> None:
        info = self._info(handle)
        handle.info = info
        self._infos[handle.handle_id] = info
        self._by_node.setdefault(info.node_id, {})[handle.handle_id] = info
        self.tracker.on_publish(handle.tenant, handle.conversation, info.published_unix_ms)

    def on_gone(self, handle: SimHandle) -> None:
        info = self._infos.pop(handle.handle_id, None)
        if info is not None:
            self._by_node[info.node_id].pop(handle.handle_id, None)

    def answer_demand(self, decode: DecodeState, now: float) -> list[tuple[int, str]]:
        # What the engine reports: the KV its waiting turns need beyond what is free.
        # Bytes on their way to the host tier are as good as free.
        wanted = sum(flight.reserved for flight in decode.waiting) - decode.free - decode.spilling
        node_id = decode.node.node_id
        handles = self._by_node.get(node_id)
        if wanted <= 0 or not handles:
            return []
        node = NodeInfo(
            node_id, decode.capacity, decode.retained, max(0, decode.free) / decode.capacity, wanted
        )
        snapshot = Snapshot(self.fleet.unix_ms(now), tuple(handles.values()), {node_id: node})
        return [(int(r.handle_id), r.policy) for r in self.pipeline.for_demand(snapshot, node_id)]

    def host_drop_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        """Least expected reuse per byte first, as the leader's `SpillOrder` tells a live node."""
        return self._value_order(handles, now, on_device=False)

    def device_spill_order(self, handles: Iterable[SimHandle], now: float) -> list[SimHandle]:
        """Least expected reuse per byte first, as the leader's `SpillOrder` tells a live node."""
        return self._value_order(handles, now, on_device=True)

    def _value_order(self, handles: Iterable[SimHandle], now: float, *, on_device: bool) -> list[SimHandle]:
        by_id = {str(h.handle_id): h for h in handles}
        infos = [self._info(h, on_device=on_device) for h in by_id.values()]
        snapshot = Snapshot(self.fleet.unix_ms(now), tuple(infos))
        return [by_id[i.handle_id] for i in self.pipeline.values.least_reuse_per_byte_first(infos, snapshot)]

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
