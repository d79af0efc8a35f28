"""The connector's metrics on the engine's own `/metrics`, through vLLM's connector-stats mechanism.

vLLM collects `KVConnectorStats` from the workers and from the scheduler's connector at every step,
aggregates them, and hands them to the connector class's Prometheus metrics (`build_prom_metrics`),
which the engine's API server exposes. kvplane's counts (`ConnectorMetrics`: pull checks, clipped
tokens, handles published and released, early releases, KV demand) are made in the scheduler
process; `ConnectorStatsReader` turns them into events since its last read, carried beside NIXL's own
transfer stats under `EVENTS_KEY`, and `KvplanePromMetrics` adds them to the engine's counters under
the same names. Nothing here runs in the scheduler loop beyond reading one small registry.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

# The stats' key for kvplane's events: [name, [label values], amount, kind] lists (kind "counter":
# an increment; "gauge": the current value).
EVENTS_KEY = "kvplane_events"


class KvplaneConnectorStats(NixlKVConnectorStats):  # type: ignore[misc]
    """NIXL's transfer stats plus kvplane's events; serializable like its base (lists in a dict)."""

    def reset(self) -> None:
        super().reset()
        self.data[EVENTS_KEY] = []

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Either side may be vLLM's own NIXL stats (without kvplane's key) or kvplane's.
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not self.data.get(EVENTS_KEY)

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = dict(super().reduce())
        for name, _labels, amount, kind in self.data.get(EVENTS_KEY, []):
            if kind == "counter":
                reduced[name] = reduced.get(name, 0) + amount
        return reduced


class ConnectorStatsReader:
    """What changed in a ConnectorMetrics registry since the last read, as events."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def take(self) -> list[list[Any]]:
        events: list[list[Any]] = []
        for family in self._registry.collect():
            for sample in family.samples:
                if family.type == "counter" and not sample.name.endswith("_total"):
                    continue  # `_created` timestamps
                labels = tuple(sample.labels.values())
                key = (family.name, labels)
                if family.type == "gauge":
                    if self._last.get(key) != sample.value:
                        events.append([family.name, list(labels), sample.value, "gauge"])
                else:
                    delta = sample.value - self._last.get(key, 0.0)
                    if delta:
                        events.append([family.name, list(labels), delta, "counter"])
                self._last[key] = sample.value
        return events


class KvplanePromMetrics(NixlPromMetrics):  # type: ignore[misc]
    """vLLM's NIXL metrics plus kvplane's, labelled per engine as vLLM labels its own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        definitions: dict[str, Counter | Gauge],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister({metric._name for metric in definitions.values()})
        self._kvplane: dict[str, Any] = {}
        for metric in definitions.values():
            name = metric._name  # prometheus_client keeps a counter's name without `_total`
            make = self._gauge_cls if isinstance(metric, Gauge) else self._counter_cls
            # With several API server processes, a gauge shows the latest value, as vLLM's own do.
            extra = {"multiprocess_mode": "mostrecent"} if make is Gauge else {}
            self._kvplane[name] = make(
                name=name,
                documentation=metric._documentation,
                labelnames=[*labelnames, *metric._labelnames],
                **extra,
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        nixl = {k: v for k, v in transfer_stats_data.items() if k != EVENTS_KEY}
        super().observe(nixl, engine_idx)
        engine = self.per_engine_labelvalues[engine_idx]
        for name, labels, amount, kind in transfer_stats_data.get(EVENTS_KEY, []):
            metric = self._kvplane.get(name)
            if metric is None:
                continue
            child = metric.labels(*engine, *labels)
            if kind == "gauge":
                child.set(amount)
            else:
                child.inc(amount)


def _unregister(names: set[str]) -> None:
    """Drops earlier copies of these metrics from the default registry.

    vLLM builds its stat logger, and with it these metrics, again in the same process (tests, a
    restarted engine), and first unregisters its own `vllm:` metrics the same way; ours would
    otherwise be registered twice, which prometheus_client refuses.
    """
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in names:
            REGISTRY.unregister(collector)
