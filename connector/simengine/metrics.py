"""Prometheus metrics of one sim-engine.

Names that vLLM also exports keep vLLM's names (``vllm:...``), so tools that
scrape a real engine read the simulator unchanged; what only the simulator
knows is under ``kvplane_sim_``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvplane.connector.simengine.engine_hooks import EngineLoad
from kvplane.services.common.runtime.telemetry import add_process_metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 34, 2))


class SimEngineMetrics:
    """All metric objects, in a registry of their own (one engine per registry)."""

    def __init__(self, model: str, engine_index: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        add_process_metrics(self.registry)
        self._labels = {"model_name": model, "engine": engine_index}
        names = ["model_name", "engine"]
        self._add_vllm_counters(names)
        self._add_kv_counters(names)
        self._add_gauges(names)

    def _add_vllm_counters(self, names: list[str]) -> None:
        """What vLLM counts too, under vLLM's names."""
        r = self.registry
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from",
            [*names, "source"],
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", names, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*names, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.nixl_xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds", "NIXL READ time", names, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.nixl_bytes = Histogram(
            "vllm:nixl_bytes_transferred", "Bytes per NIXL READ", names, buckets=_BYTES_BUCKETS, registry=r
        )
        self.nixl_failed = Counter(
            "vllm:nixl_num_failed_transfers", "NIXL transfers that failed", names, registry=r
        )
        self.nixl_expired = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Retained requests freed by their timeout, never read",
            names,
            registry=r,
        )

    def _add_kv_counters(self, names: list[str]) -> None:
        """What only the simulator counts: its KV loads, frees, notifications and checks."""
        r = self.registry
        self.alone_prompt_tokens = Counter(
            "kvplane_sim_alone_prompt_tokens",
            "Prompt tokens of requests that were neither leg of a P/D turn, by where their KV came from",
            [*names, "source"],
            registry=r,
        )
        self.notifs_unmatched = Counter(
            "kvplane_sim_notifications_unmatched",
            "Read notifications for requests not held (any more)",
            [*names, "kind"],
            registry=r,
        )
        self.verify_failures = Counter(
            "kvplane_sim_kv_verify_failures",
            "Pulled blocks that failed verification; never used",
            [*names, "reason"],
            registry=r,
        )
        self.kv_loads = Counter(
            "kvplane_sim_kv_loads", "Remote KV loads by outcome", [*names, "leg", "outcome"], registry=r
        )
        self.frees = Counter(
            "kvplane_sim_retained_frees",
            "Retained handles freed, by cause",
            [*names, "kind", "reason"],
            registry=r,
        )
        self.handshakes = Counter(
            "kvplane_sim_handshakes",
            "Side-channel handshakes made, by outcome",
            [*names, "outcome"],
            registry=r,
        )
        # Same name as kvplane's vLLM connector exports, so both read alike.
        self.pull_checks = Counter(
            "kvplane_connector_pull_checks",
            "Prefill-side checks of a decode handle against the prompt, by outcome",
            [*names, "outcome"],
            registry=r,
        )
        self.spills = Counter(
            "kvplane_sim_host_spills",
            "Handles moved to the host tier, their relocation stored (moved), or not: read or freed"
            " during the copy (freed_first), larger than the whole tier (no_room), relocation"
            " refused by the control plane or never published (refused); copies made ahead of a move"
            " (copied_ahead), or not for want of room (no_room_ahead)",
            [*names, "outcome"],
            registry=r,
        )
        self.host_reads = Counter(
            "kvplane_sim_host_reads", "Handles read by their puller from the host tier", names, registry=r
        )
        self.kv_waits = Histogram(
            "kvplane_sim_kv_wait_seconds",
            "How long a request that found too few free KV blocks waited for them (given or timed out)",
            names,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.shared = Counter(
            "kvplane_sim_shared_leased_blocks",
            "Blocks a new lease shared with an older live one: copied, or restamped (older one voided)",
            [*names, "action"],
            registry=r,
        )

    def _add_gauges(self, names: list[str]) -> None:
        """The engine's load, set at each scrape."""
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests running", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", names, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use", names, registry=r)
        self.free_blocks = Gauge("kvplane_sim_kv_free_blocks", "Free KV blocks", names, registry=r)
        self.total_blocks = Gauge("kvplane_sim_kv_total_blocks", "KV blocks in all", names, registry=r)
        self.retained_bytes = Gauge(
            "kvplane_sim_retained_bytes", "Bytes held for remote readers", names, registry=r
        )
        self.retained_handles = Gauge(
            "kvplane_sim_retained_handles", "Handles and leases held", names, registry=r
        )
        self.queued_prefill_tokens = Gauge(
            "kvplane_sim_queued_prefill_tokens", "Prompt tokens waiting", names, registry=r
        )
        self.host_total_blocks = Gauge(
            "kvplane_sim_host_total_blocks", "Blocks of the host tier", names, registry=r
        )
        self.host_free_blocks = Gauge(
            "kvplane_sim_host_free_blocks", "Free blocks of the host tier", names, registry=r
        )
        self.host_retained_bytes = Gauge(
            "kvplane_sim_host_retained_bytes", "Bytes of handles held in the host tier", names, registry=r
        )

    def count_prompt(
        self, local_cache_hit: int, external: int, local_compute: int, *, alone: bool = False
    ) -> None:
        """A request's prompt tokens by source; `alone`: the request was neither leg of a P/D turn
        (an engine serving a turn by itself, as D does one routed prefill_on_decode)."""
        lb = self._labels
        self.prompt_tokens.labels(**lb).inc(local_cache_hit + external + local_compute)
        self.prompt_tokens_by_source.labels(**lb, source="local_cache_hit").inc(local_cache_hit)
        self.prompt_tokens_by_source.labels(**lb, source="external_kv_transfer").inc(external)
        self.prompt_tokens_by_source.labels(**lb, source="local_compute").inc(local_compute)
        if alone:
            self.alone_prompt_tokens.labels(**lb, source="local_cache_hit").inc(local_cache_hit)
            self.alone_prompt_tokens.labels(**lb, source="local_compute").inc(local_compute)

    def load_outcome(self, leg: str, outcome: str) -> None:
        self.kv_loads.labels(**self._labels, leg=leg, outcome=outcome).inc()

    def verify_failure(self, reason: str) -> None:
        self.verify_failures.labels(**self._labels, reason=reason).inc()

    def freed(self, kind: str, reason: str) -> None:
        self.frees.labels(**self._labels, kind=kind, reason=reason).inc()

    def handshake(self, outcome: str) -> None:
        self.handshakes.labels(**self._labels, outcome=outcome).inc()

    def unmatched_notif(self, kind: str) -> None:
        self.notifs_unmatched.labels(**self._labels, kind=kind).inc()

    def shared_blocks(self, copied: int, restamped: int) -> None:
        if copied:
            self.shared.labels(**self._labels, action="copied").inc(copied)
        if restamped:
            self.shared.labels(**self._labels, action="restamped").inc(restamped)

    def spill(self, outcome: str) -> None:
        self.spills.labels(**self._labels, outcome=outcome).inc()

    def host_read(self) -> None:
        self.host_reads.labels(**self._labels).inc()

    def kv_waited(self, seconds: float) -> None:
        self.kv_waits.labels(**self._labels).observe(seconds)

    def pull_check(self, outcome: str) -> None:
        self.pull_checks.labels(**self._labels, outcome=outcome).inc()

    def transfer(self, seconds: float, nbytes: int) -> None:
        self.nixl_xfer_time.labels(**self._labels).observe(seconds)
        self.nixl_bytes.labels(**self._labels).observe(nbytes)

    def transfer_failed(self) -> None:
        self.nixl_failed.labels(**self._labels).inc()

    def expired(self) -> None:
        self.nixl_expired.labels(**self._labels).inc()

    def finished(self, reason: str, generated: int) -> None:
        self.request_success.labels(**self._labels, finished_reason=reason).inc()
        self.generation_tokens.labels(**self._labels).inc(generated)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(**self._labels).observe(seconds)

    def render(self, load: EngineLoad) -> bytes:
        lb = self._labels
        self.running.labels(**lb).set(load.running_requests)
        self.waiting.labels(**lb).set(load.queued_requests)
        self.free_blocks.labels(**lb).set(load.free_kv_blocks)
        self.total_blocks.labels(**lb).set(load.total_kv_blocks)
        self.kv_usage.labels(**lb).set(1 - load.free_kv_blocks / max(load.total_kv_blocks, 1))
        self.retained_bytes.labels(**lb).set(load.retained_bytes)
        self.retained_handles.labels(**lb).set(load.retained_handles)
        self.queued_prefill_tokens.labels(**lb).set(load.queued_prefill_tokens)
        self.host_total_blocks.labels(**lb).set(load.host_total_blocks)
        self.host_free_blocks.labels(**lb).set(load.host_free_blocks)
        self.host_retained_bytes.labels(**lb).set(load.host_retained_bytes)
        return bytes(generate_latest(self.registry))
