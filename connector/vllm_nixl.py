"""kvplane's NixlConnector for vLLM: retained handles, releases and the prefix check.

Load it on every engine with

    --kv-transfer-config '{"kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvplane.connector.vllm_nixl",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
            "kvplane": {"metadata_target": "127.0.0.1:50051", "node_id": "d-0",
                        "role": "decode", "http_url": "http://127.0.0.1:8000"}}}'

It runs on vLLM 0.32 and 0.33: at construction it checks the parts of vLLM it relies on and
refuses to start, naming what is missing, or warns on an untested release
(`kvplane.connector.vllm_features`). The class keeps vLLM's name, `NixlConnector`, because vLLM
checks connectors by class name in places. It subclasses vLLM's pull connector and changes
nothing on the worker side. In the scheduler process it adds:

- `request_finished*` (D): on a natural finish with retained blocks, publish the handle (with
  token digests, retained bytes, tenant and conversation) through the node agent;
- `update_connector_output`: every published request in `finished_sending` is reported released;
- reconcile: at every (re)registration the node agent asks the control plane which of the
  published requests whose blocks this engine still holds (`_retained_request_ids`) nothing
  references any more (purged while the node was away) and queues their early release;
- `build_connector_meta`: early releases queued by the agent's release commands take effect;
  the workers free those blocks in that step;
- KV demand: `get_num_new_matched_tokens` and `update_state_after_alloc` show which waiting
  requests the scheduler tried this step and could not give blocks; `build_connector_meta`
  turns what they need, beyond the free blocks, into the demand the node agent sends the
  eviction leader (`_current_demand`, read on the agent's thread, less the blocks of releases
  already on their way). `has_pending_block_frees` answers True while such releases are in
  flight, so vLLM waits a step for their blocks instead of preempting a running request;
- `get_num_new_matched_tokens` (P): the pull is verified against the prompt and clipped
  (`kvplane.connector.prefix_check`) before vLLM sees it;
- a host tier (D, `host_tier_p2p`): run first in vLLM's MultiConnector beside its
  OffloadingConnector, a D short of blocks moves handles whose first blocks the CPU tier holds
  to that tier (in the leader's spill order) before it asks for memory, moves those the leader
  names in a MoveCommand, and frees their GPU blocks once the move is stored
  (`kvplane.connector.vllm_host_tier`).

Every network call happens on the node agent's thread; these hooks only enqueue. The
`kvplane` section of `kv_connector_extra_config` is read by `ConnectorSettings.from_config`
(KVPLANE_METADATA_TARGET, KVPLANE_EVICTION_TARGET, KVPLANE_ROUTING_TARGETS, KVPLANE_NODE_ID,
KVPLANE_NODE_ROLE and KVPLANE_HTTP_URL give defaults):

    metadata_target, eviction_target   host:port of the services (eviction: default metadata)
    routing_targets                    every routing replica, host:port, comma-separated: the node
                                       agent streams the engine's load, and P's prefix cache from
                                       its KV events, to each (empty: neither)
    node_id, role, http_url            how the node registers (role: prefill, decode or both)
    require_digests                    P refuses a pull whose handle has no digests (true)
    expiry_margin_s                    taken off D's deadline for the wall-clock expiry (1.0)
    metrics_port                       serve the connector's Prometheus metrics here (0: off)
    lease_ttl_s, load_interval_s       the node agent's lease and load sampling period (10, 0.5)
    load_heartbeat_s                   longest gap between load reports of an unchanged load (10)
    release_linger_s                   D: how long the report that P read a handle's blocks waits
                                       for the turn's next publish, to go in its etcd transaction
                                       (5; 0: at once); longer than a turn's decode here
    nixl_progress_thread               false: NIXL agents without their busy progress thread
    idle_step_pause_s                  pause in steps that schedule nothing and watch no pull (0.01;
                                       0: off)
    kv_free_watermark_blocks           free blocks to ask the control plane for on top of what
                                       waiting requests need (0: ask only for waiting requests)
    host_tier_p2p                      D: host:port of the OffloadingConnector's P2P tier, where
                                       P reads handles moved to the CPU tier (empty: no host tier;
                                       needs the engine's KV events read on its host)
    host_tier_ttl_s                    D: how long after its turn a moved handle stays offered,
                                       unless the CPU tier drops it first (3600; never less than
                                       the device handle's own life)
    auth_token_file                    file holding the node's bearer token (KVPLANE_AUTH_TOKEN_FILE;
                                       KVPLANE_AUTH_TOKEN gives the token itself, never a config key)
    tls_ca_file                        CA of the control plane's certificates: TLS (KVPLANE_TLS_CA_FILE)
    tls_cert_file, tls_key_file        the node's client certificate, for mTLS (KVPLANE_TLS_CERT_FILE, ...)
    tls_server_name                    the name the servers' certificates are checked against
    mesh_secret_file                   a mesh proxy's secret, only where no proxy adds it (development)

A control plane that refuses these credentials is logged at warning level by the node agent,
with the reason.

Without a `metadata_target` the connector runs without an agent: the prefix check still
applies, and nothing is published.

Keys it adds to P's finish-time kv_transfer_params: `kvplane_pulled_tokens` (prompt tokens loaded
from the holder; the gateway counts them apart from P's prefix-cache hits) and, for a pull,
`kvplane_pull_ms` (from the blocks' allocation to the step that reported the load done; routing
learns its pull costs from it), and `kvplane_queued_ms` (from the request's arrival to its blocks'
allocation: its wait for P's compute, which routing takes off the P leg's time to learn P's
compute alone). Keys it adds to D's
finish-time kv_transfer_params: `kvplane_handle_id`, `kvplane_digests`
(`kvplane.connector.digests.encode`) and `kvplane_tail_digest`. It reads `kvplane_tenant`,
`kvplane_conversation` and `kvplane_handle_id` from the request's params (the router's), and
on P `kvplane_digests` and `kvplane_tail_digest` from the handle it is given.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import vllm
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvplane.connector import prefix_check, vllm_features
from kvplane.connector.kv_events.vllm_config import source_from_vllm_config
from kvplane.connector.node_agent import NodeAgent, NodeAgentSettings
from kvplane.connector.request_spans import current_trace_context, request_span
from kvplane.connector.vllm_features import IncompatibleVllm
from kvplane.connector.vllm_host_tier import HostTier, parse_endpoint
from kvplane.connector.vllm_stats import (
    EVENTS_KEY,
    ConnectorStatsReader,
    KvplaneConnectorStats,
    KvplanePromMetrics,
)
from kvplane.services.client.credentials import ClientCredentials
from kvplane.services.common.model.handles import (
    KEY_PULL_MS,
    KEY_PULLED_TOKENS,
    KEY_QUEUED_MS,
    KEY_RETAIN,
    EngineHandles,
    routed_to,
)
from kvplane.services.common.model.kv_events import MEDIUM_CPU
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
from kvplane.services.common.runtime.telemetry import Telemetry

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector
except ImportError as exc:  # a release without the pull connector: say so, by name
    raise IncompatibleVllm(
        f"kvplane.connector.vllm_nixl cannot run on vLLM {vllm.__version__}: it lacks "
        f"vllm.distributed.kv_transfer.kv_connector.v1.nixl.NixlPullConnector ({exc})"
    ) from exc

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class ConnectorConfigError(ValueError):
    """The `kvplane` section of kv_connector_extra_config is malformed."""


def check_installed_vllm(*, progress_thread_off: bool = False) -> None:
    """Fail fast on a vLLM without what this connector relies on, naming what is missing;
    warn on a release that has it all but was never tested (`kvplane.connector.vllm_features`).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata, base_worker
    from vllm.v1.outputs import KVConnectorOutput

    missing = vllm_features.missing_features(
        NixlPullConnector,
        NixlConnectorMetadata,
        KVConnectorOutput,
        base_worker if progress_thread_off else None,
    )
    vllm_features.check_vllm(str(vllm.__version__), missing)


# Credential settings read from the config section or KVPLANE_<KEY> (never the token itself).
_CREDENTIAL_KEYS = (
    "auth_token_file",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "tls_server_name",
    "mesh_secret_file",
)


def _targets(value: Any) -> tuple[str, ...]:
    """host:port targets from a list or a comma-separated string."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return tuple(str(t).strip() for t in items if str(t).strip())


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """kvplane's part of the engine configuration."""

    metadata_target: str = ""
    eviction_target: str = ""
    # Routing replicas (host:port) the node agent streams this engine's load to, and its prefix
    # cache from its KV events (vLLM's --kv-events-config, on loopback or ipc); empty: neither.
    routing_targets: tuple[str, ...] = ()
    node_id: str = ""
    role: NodeRole = NodeRole.BOTH
    http_url: str = ""
    # P side: refuse a pull whose handle carries no digests.
    require_digests: bool = True
    # Subtracted from D's block deadline when it is turned into a wall-clock expiry (seconds).
    expiry_margin_s: float = 1.0
    # Serve the connector's Prometheus metrics on this port of 127.0.0.1; 0: do not serve.
    metrics_port: int = 0
    lease_ttl_s: int = 10
    load_interval_s: float = 0.5
    load_heartbeat_s: float = 10.0
    # D side: seconds the report that P read a handle's blocks waits for the turn's next publish
    # (the node agent's `release_linger_s`).
    release_linger_s: float = 5.0
    # Worker side: whether NIXL runs its progress thread. NIXL's Python agent starts it with a
    # zero polling delay, so it keeps one core busy per engine for the engine's whole life.
    # Without it, transfers and notifications progress when the worker polls NIXL, which it does
    # every engine step. Turn it off on small CPU machines.
    nixl_progress_thread: bool = True
    # Scheduler side: seconds to pause in a step that schedules no tokens while no KV load is in
    # flight. vLLM keeps stepping while it holds finished requests' blocks (D for as long as it
    # retains a handle, which with retention is always; P until D reads), back to back with empty
    # batches, each a round trip to the workers: an idle D burns more than a core. With the
    # pause, a request arriving during an idle step waits up to this long; a step that has a
    # pull to watch never pauses. 0: step back to back, as vLLM does.
    idle_step_pause_s: float = 0.01
    # Scheduler side: free blocks asked for on top of what waiting requests need. 0: memory is
    # asked for only when a request waits for it, never kept empty ahead of need.
    kv_free_watermark_blocks: int = 0
    # D side, with vLLM's OffloadingConnector beside this one (MultiConnector) and the engine's
    # KV events read: host:port where peers reach the OffloadingConnector's P2P tier. Set, a D
    # short of blocks moves handles whose first blocks the CPU tier holds to the host tier, in the
    # control plane's spill order, before asking it for memory (`kvplane.connector.vllm_host_tier`).
    # Empty: no host tier.
    host_tier_p2p: str = ""
    # Seconds after its turn a moved handle stays offered (the CPU tier's LRU may end it sooner).
    host_tier_ttl_s: float = 3600.0
    # Credentials for the control plane (kvplane.services.client.credentials); see the module docstring.
    auth_token_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    mesh_secret_file: str = ""
    # From KVPLANE_AUTH_TOKEN only: vLLM logs its whole configuration.
    auth_token: str = field(default="", repr=False)

    def credentials(self) -> ClientCredentials:
        return ClientCredentials(
            token=self.auth_token,
            token_file=self.auth_token_file,
            tls_ca_file=self.tls_ca_file,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
            tls_server_name=self.tls_server_name,
            mesh_secret_file=self.mesh_secret_file,
        )

    def agent_settings(self) -> NodeAgentSettings:
        """The node agent's settings: where the control plane is, the lease, the load sampling."""
        return NodeAgentSettings(
            metadata_target=self.metadata_target,
            eviction_target=self.eviction_target,
            lease_ttl_s=self.lease_ttl_s,
            load_interval_s=self.load_interval_s,
            load_heartbeat_s=max(self.load_heartbeat_s, self.load_interval_s),
            release_linger_s=self.release_linger_s,
            credentials=self.credentials(),
            routing_targets=self.routing_targets,
        )

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Build from kv_connector_extra_config["kvplane"], with KVPLANE_* variables as defaults."""
        env = os.environ if env is None else env
        raw: dict[str, Any] = {
            "metadata_target": env.get("KVPLANE_METADATA_TARGET", ""),
            "eviction_target": env.get("KVPLANE_EVICTION_TARGET", ""),
            "routing_targets": env.get("KVPLANE_ROUTING_TARGETS", ""),
            "node_id": env.get("KVPLANE_NODE_ID", ""),
            "http_url": env.get("KVPLANE_HTTP_URL", ""),
        }
        for key in _CREDENTIAL_KEYS:
            if f"KVPLANE_{key.upper()}" in env:
                raw[key] = env[f"KVPLANE_{key.upper()}"]
        if "auth_token" in (section or {}):
            raise ConnectorConfigError("put the token in a file (auth_token_file) or KVPLANE_AUTH_TOKEN")
        if "KVPLANE_NODE_ROLE" in env:
            raw["role"] = env["KVPLANE_NODE_ROLE"]
        raw.update(section or {})
        unknown = set(raw) - (set(cls.__dataclass_fields__) - {"auth_token"})
        if unknown:
            raise ConnectorConfigError(f"unknown kvplane settings: {sorted(unknown)}")
        try:
            raw["role"] = NodeRole(raw.get("role", NodeRole.BOTH.value))
            return cls(
                metadata_target=str(raw["metadata_target"]),
                eviction_target=str(raw["eviction_target"]),
                routing_targets=_targets(raw.get("routing_targets", "")),
                node_id=str(raw["node_id"]),
                role=raw["role"],
                http_url=str(raw["http_url"]),
                require_digests=bool(raw.get("require_digests", True)),
                expiry_margin_s=float(raw.get("expiry_margin_s", 1.0)),
                metrics_port=int(raw.get("metrics_port", 0)),
                lease_ttl_s=int(raw.get("lease_ttl_s", 10)),
                load_interval_s=float(raw.get("load_interval_s", 0.5)),
                load_heartbeat_s=float(raw.get("load_heartbeat_s", 10.0)),
                release_linger_s=_non_negative(raw.get("release_linger_s", 5.0), "release_linger_s"),
                nixl_progress_thread=bool(raw.get("nixl_progress_thread", True)),
                idle_step_pause_s=float(raw.get("idle_step_pause_s", 0.01)),
                kv_free_watermark_blocks=int(raw.get("kv_free_watermark_blocks", 0)),
                host_tier_p2p=_host_tier_endpoint(raw.get("host_tier_p2p", "")),
                host_tier_ttl_s=_non_negative(raw.get("host_tier_ttl_s", 3600.0), "host_tier_ttl_s"),
                auth_token=str(env.get("KVPLANE_AUTH_TOKEN", "")),
                **{key: str(raw.get(key, "")) for key in _CREDENTIAL_KEYS},
            )
        except (TypeError, ValueError) as exc:
            raise ConnectorConfigError(f"bad kvplane settings: {exc}") from None


def _non_negative(value: Any, name: str) -> float:
    number = float(value)
    if not number >= 0 or number == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
    return number


def _host_tier_endpoint(value: Any) -> str:
    """The host_tier_p2p setting, checked: empty, or host:port."""
    text = str(value or "").strip()
    if text:
        parse_endpoint(text)
    return text


class ConnectorMetrics:
    """The connector's Prometheus metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.pull_checks = Counter(
            "kvplane_connector_pull_checks_total",
            "Prefill-side checks of a decode handle against the prompt, by outcome "
            "(verified, clipped, dropped, no_digests)",
            ["outcome"],
            registry=self.registry,
        )
        self.clipped_tokens = Counter(
            "kvplane_connector_clipped_tokens_total",
            "Handle tokens not pulled because the prompt did not verifiably continue them",
            registry=self.registry,
        )
        self.published = Counter(
            "kvplane_connector_handles_published_total",
            "Retained handles handed to the node agent",
            registry=self.registry,
        )
        self.released = Counter(
            "kvplane_connector_handles_released_total",
            "Published handles whose blocks the engine freed",
            registry=self.registry,
        )
        self.early_releases = Counter(
            "kvplane_connector_early_releases_total",
            "Early releases applied on command, by result (applied, unknown)",
            ["result"],
            registry=self.registry,
        )
        self.kv_demand = Gauge(
            "kvplane_connector_kv_demand_blocks",
            "KV blocks waiting requests need beyond the free blocks, at the last scheduler step",
            registry=self.registry,
        )
        self.host_moves = Counter(
            "kvplane_connector_host_moves_total",
            "Retained handles moved to the CPU offloading tier, by outcome (sent; stored: their "
            "GPU blocks freed; refused: the handle had been checked out, released or superseded)",
            ["outcome"],
            registry=self.registry,
        )
        self.host_handles_ended = Counter(
            "kvplane_connector_host_handles_ended_total",
            "Moved handles ended, by reason (released: a release command; ended: the CPU tier "
            "dropped their first block, or they expired)",
            ["reason"],
            registry=self.registry,
        )

    def definitions(self) -> dict[str, Counter | Gauge]:
        """Every metric, by attribute name: what the engine's /metrics mirrors (vllm_stats.py)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, Counter | Gauge)}

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample, 0 when absent (for tests and logs)."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


@dataclass(frozen=True, slots=True)
class _Held:
    """A published handle whose blocks this engine still holds."""

    handle_id: str
    retained_bytes: int
    # The handle's wall-clock expiry (0: not known): blocks freed before it, and not by an early
    # release, were read by P.
    expiry_unix_ms: int = 0


class NixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's pull NixlConnector plus kvplane's hooks (scheduler role only)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        _log_through_vllm_handlers()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        settings = ConnectorSettings.from_config(extra.get("kvplane"))
        check_installed_vllm(progress_thread_off=not settings.nixl_progress_thread)
        if role == KVConnectorRole.WORKER and not settings.nixl_progress_thread:
            with _nixl_agents_without_progress_thread():
                super().__init__(vllm_config, role, kv_cache_config)
        else:
            super().__init__(vllm_config, role, kv_cache_config)
        self.kvplane_settings = settings
        self.kvplane_metrics = ConnectorMetrics()
        # Scheduler: what the metrics counted since vLLM last collected the connector's stats.
        self._stats_reader = ConnectorStatsReader(self.kvplane_metrics.registry)
        # Spans of requests that carry trace headers (request_spans.py); exported where
        # OpenTelemetry's variables say, as `kvplane-connector`.
        self._telemetry: Telemetry | None = None
        self._tracer: trace.Tracer = trace.NoOpTracer()
        self.kvplane_agent: NodeAgent | None = None
        self._model_name = _served_model_name(vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._bytes_per_block = _bytes_per_block(kv_cache_config) if kv_cache_config is not None else 0
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        # D's handles after a turn: the same builder as the sim-engine's.
        self._handles = EngineHandles(
            self._model_name, self._block_size, self._bytes_per_block, settings.expiry_margin_s
        )
        # Scheduler-thread state.
        self._held: dict[str, _Held] = {}
        # P side: finished requests whose blocks wait for D's read (vLLM's lease), by request id.
        self._prefill_held: set[str] = set()
        self._running_requests = 0
        # Filled on the agent thread, drained on the scheduler thread.
        self._release_lock = threading.Lock()
        self._pending_releases: list[str] = []
        # Under _release_lock: MoveCommands taken (request ids), made at the next step.
        self._pending_moves: list[str] = []
        self._drain_requested = False
        self._draining = False
        self._load = NodeLoad(node_id="", incarnation="")
        # KV demand. Scheduler thread: blocks each waiting request tried this step needs; a
        # request given blocks leaves it (update_state_after_alloc).
        self._asked: dict[str, int] = {}
        # P side: prompt tokens vLLM loads from the holder, per request, reported at finish; when
        # each load began (its blocks' allocation, time.monotonic()), and how long it took (ms).
        self._pulled: dict[str, int] = {}
        self._pull_started: dict[str, float] = {}
        self._pull_ms: dict[str, float] = {}
        # And how long each waited for the scheduler before its blocks were allocated (ms): from
        # its arrival (vLLM's `Request.arrival_time`, wall clock) to then.
        self._queued_ms: dict[str, float] = {}
        # Scheduler thread: a running request found no block this step (has_pending_block_frees).
        self._running_short = False
        # Under _release_lock: blocks wanted beyond the free ones at the last schedule, and the
        # blocks of early releases applied and not yet freed, by request id.
        self._shortfall = 0
        self._freeing: dict[str, int] = {}
        # Scheduler thread: the demand the agent was last woken for.
        self._demand_notified = 0
        # D side, scheduler thread: kvplane's turns that D serves alone (prefill_on_decode), given
        # blocks since the last step's metadata: the workers must track them as D legs.
        self._bidirectional = bool(extra.get("bidirectional_kv_xfer"))
        self._served_alone: set[str] = set()
        # Scheduler thread: how an idle step pauses (idle_step_pause_s).
        self._pause = time.sleep
        # D side: handles moved to the CPU offloading tier (host_tier_p2p); GPU blocks of the
        # moves awaiting the control plane (written on the scheduler thread, read on the agent's).
        self._host_tier: HostTier | None = None
        self._moving_blocks = 0
        if role == KVConnectorRole.SCHEDULER:
            if settings.host_tier_p2p:
                self._host_tier = HostTier(
                    parse_endpoint(settings.host_tier_p2p),
                    self._block_size,
                    self._bytes_per_block,
                    self._cpu_prefix,
                    ttl_s=settings.host_tier_ttl_s,
                )
            self._start_kvplane(vllm_config)

    # ------------------------------------------------------------------ set-up

    def _start_kvplane(self, vllm_config: VllmConfig) -> None:
        s = self.kvplane_settings
        self._telemetry = Telemetry.create("kvplane-connector")
        self._tracer = self._telemetry.tracer
        if s.metrics_port:
            start_http_server(s.metrics_port, addr="127.0.0.1", registry=self.kvplane_metrics.registry)
        if not s.metadata_target:
            log.warning("kvplane: no metadata_target configured; handles will not be published")
            return
        if not s.http_url:
            log.warning("kvplane: no http_url configured; the control plane will refuse to register the node")
        node = _engine_node(self, vllm_config)
        # The engine's own KV events (if it publishes them), read locally by the agent; events
        # kvplane cannot read (an xxhash algorithm, a remote endpoint) leave routing its record.
        try:
            kv_events = source_from_vllm_config(vllm_config)
        except ValueError as exc:
            log.warning("kvplane: the engine's KV events are not read: %s", exc)
            kv_events = None
        self.kvplane_agent = NodeAgent(
            s.agent_settings(),
            node,
            self._current_load,
            self._queue_release,
            on_drain=self._queue_drain,
            demand_fn=self._current_demand,
            retained_fn=self._retained_request_ids,
            kv_events=kv_events,
            # Only an engine with a host tier asks for the order of its moves there, and takes moves.
            on_spill_order=self._host_tier.set_order if self._host_tier is not None else None,
            on_move=self._queue_move if self._host_tier is not None else None,
        )
        if self._host_tier is not None and not self.kvplane_agent.reads_kv_events:
            log.warning(
                "kvplane: host_tier_p2p is set but the engine's KV events are not read "
                "(--kv-events-config): no handle is moved to the CPU tier"
            )
            self._host_tier = None
        self.kvplane_agent.start()
        log.info(
            "kvplane: node agent started for %s (incarnation %s)",
            node.node_id,
            self.kvplane_agent.incarnation,
        )

    def shutdown(self) -> None:
        """Called by the engine at shutdown, in both roles: stop the agent, then vLLM's parts."""
        if self.kvplane_agent is not None:
            self.kvplane_agent.stop()
            self.kvplane_agent = None
        if self._telemetry is not None:
            self._telemetry.shutdown()
            self._telemetry = None
        super().shutdown()

    # ------------------------------------------------------------------ agent-thread callbacks

    def _queue_release(self, remote_request_id: str) -> None:
        """Agent thread: a release command arrived. Applied at the next build_connector_meta."""
        with self._release_lock:
            self._pending_releases.append(remote_request_id)

    def _queue_move(self, remote_request_id: str) -> str:
        """Agent thread: a MoveCommand arrived. "" when it is made at the next step (or the
        handle is gone); else why it cannot be."""
        tier = self._host_tier
        if tier is None or self._draining:
            return "no host tier, or the engine is draining"
        refused = tier.refuses_move(remote_request_id)
        if not refused:
            with self._release_lock:
                self._pending_moves.append(remote_request_id)
        return refused

    def _queue_drain(self) -> None:
        """Agent thread: release every held handle and publish no more."""
        with self._release_lock:
            self._drain_requested = True

    def _cpu_prefix(self, block_ids: Sequence[int]) -> int:
        """How many of a chain's leading blocks the CPU offloading tier holds (its KV events)."""
        agent = self.kvplane_agent
        return 0 if agent is None else agent.held_prefix(block_ids, MEDIUM_CPU)

    def _retained_request_ids(self) -> list[str]:
        """Agent thread, at every (re)registration: the published requests whose blocks this
        engine holds for a pull. P's blocks waiting for D's read were never published, so they
        are not asked about. `dict.copy` is one call under the GIL: a consistent snapshot while
        the scheduler thread adds and removes entries."""
        return list(self._held.copy())

    def _current_load(self) -> NodeLoad:
        """Agent thread: the latest snapshot the scheduler thread made (an atomic read)."""
        return self._load

    def _current_demand(self) -> int:
        """Agent thread: KV blocks wanted beyond the free ones, less those already coming back
        (release commands queued or applied and not yet freed). A command is queued here before
        the agent acknowledges it, so a report sent after an ack never asks for its blocks again.
        """
        with self._release_lock:
            coming = sum(self._freeing.values()) + self._moving_blocks
            coming += sum(self._held_blocks(req_id) for req_id in self._pending_releases)
            return max(0, self._shortfall - coming)

    def _held_blocks(self, req_id: str) -> int:
        """Blocks a held request pins; 0 when not held (one dict read: safe from any thread)."""
        held = self._held.get(req_id)
        if held is None or not self._bytes_per_block:
            return 0
        return held.retained_bytes // self._bytes_per_block

    # ------------------------------------------------------------------ scheduler hooks

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: NIXL's transfer stats. Scheduler: kvplane's counts since the last call (every
        step, after update_connector_output). vLLM aggregates both and records them with
        `build_prom_metrics`'s metrics on the engine's own /metrics (`kvplane.connector.vllm_stats`).
        """
        if self.connector_worker is not None:
            stats = super().get_kv_connector_stats()
            return None if stats is None else KvplaneConnectorStats(data={**stats.data, EVENTS_KEY: []})
        events = self._stats_reader.take()
        if not events:
            return None
        stats = KvplaneConnectorStats()
        stats.data[EVENTS_KEY] = events
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvplaneConnectorStats(data=data) if data is not None else KvplaneConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return KvplanePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, ConnectorMetrics().definitions()
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler process. Before vLLM sizes a pull from a decode engine's handle, verify
        the handle's digests against the prompt and clip the pull to the verified prefix.

        May be called several times for one request (it waits for blocks, or is preempted):
        the check runs once and later calls see the same clipped params. Must not block.
        """
        params = request.kv_transfer_params
        if prefix_check.is_pull_handle(params) and prefix_check.CHECKED_KEY not in params:
            with request_span(self._tracer, "kvplane.pull_check", _trace_headers(request)) as span:
                check = prefix_check.check_pull(
                    params,
                    request.prompt_token_ids or (),
                    require_digests=self.kvplane_settings.require_digests,
                )
                if span is not None:
                    span.set_attribute("kvplane.pull.outcome", check.outcome.value)
                    span.set_attribute("kvplane.tokens.verified", check.verified_tokens)
                    span.set_attribute("kvplane.tokens.handle", check.handle_tokens)
            self.kvplane_metrics.pull_checks.labels(check.outcome.value).inc()
            if check.changed:
                self.kvplane_metrics.clipped_tokens.inc(max(0, check.handle_tokens - check.verified_tokens))
                log.info(
                    "kvplane: pull for %s %s: %d of %d handle tokens verified",
                    request.request_id,
                    check.outcome.value,
                    check.verified_tokens,
                    check.handle_tokens,
                )
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        # A waiting request being tried: what it needs beyond its local prefix-cache hit counts
        # as KV demand unless it is given blocks this step (update_state_after_alloc).
        needed = -(-int(request.num_tokens) // self._block_size) - num_computed_tokens // self._block_size
        self._asked[request.request_id] = max(0, needed)
        return result

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Scheduler process, when a waiting request has been given its blocks: it wants no more.

        A turn of kvplane's that D serves alone (routed prefill_on_decode: params naming no remote
        blocks) is kept at its finish as a D leg is, but vLLM tells its workers only of the P/D
        legs it batched: without this, no deadline, release or read notification would ever free
        its blocks. It joins the next step's `reqs_in_batch`, as a D leg does."""
        self._asked.pop(request.request_id, None)
        if num_external_tokens > 0:
            self._pulled[request.request_id] = num_external_tokens
            self._pull_started[request.request_id] = time.monotonic()
        params = request.kv_transfer_params or {}
        arrived = getattr(request, "arrival_time", None)
        if params.get("do_remote_decode") and isinstance(arrived, float | int) and arrived > 0:
            # A P leg's wait for P's compute: until its blocks were given, the first time (a
            # preempted request given blocks again has been computing already). A pull then runs
            # before its compute, and is reported apart.
            self._queued_ms.setdefault(request.request_id, max(0.0, (time.time() - arrived) * 1000))
        if (
            self._bidirectional
            and not params.get("do_remote_decode")
            and not params.get("do_remote_prefill")
            and routed_to(params) is not None
        ):
            self._served_alone.add(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def has_pending_block_frees(self) -> bool:
        """Scheduler process, before vLLM preempts a running request for want of a block.

        True while early releases are on their way (queued by a release command, or applied and
        not yet freed): their blocks come back within a step or two, so the request waits a
        step rather than losing its computed KV. The shortage itself is reported as demand, so
        the control plane releases a handle for it. Must not block.
        """
        self._running_short = True
        with self._release_lock:
            coming = bool(self._freeing) or any(r in self._held for r in self._pending_releases)
        return coming or bool(super().has_pending_block_frees())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler process, once per finished request (single KV-cache group engines)."""
        delay_free, params = super().request_finished(request, block_ids)
        return delay_free, self._after_finish(request, delay_free, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler process, once per finished request. On a natural finish with blocks kept
        for a next turn (D side), queue the handle for publishing. Aborts and errors publish
        nothing: vLLM frees their blocks. Must not block: publishing is the agent's job.
        """
        delay_free, params = super().request_finished_all_groups(request, block_ids)
        return delay_free, self._after_finish(request, delay_free, params)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler process, every step. Each published request in finished_sending has just
        had its blocks freed (read by P, expired or released early): report it."""
        super().update_connector_output(connector_output)
        now = time.monotonic()
        for req_id in connector_output.finished_recving or ():
            started = self._pull_started.pop(req_id, None)
            if started is not None:
                self._pull_ms[req_id] = (now - started) * 1000
        for req_id in connector_output.finished_sending or ():
            self._prefill_held.discard(req_id)
            with self._release_lock:
                # Freed now: no longer coming, and no longer missing either.
                freed = self._freeing.pop(req_id, 0)
                self._shortfall = max(0, self._shortfall - freed)
            held = self._held.pop(req_id, None)
            if held is None:
                continue
            tier = self._host_tier
            if tier is not None:
                if tier.is_moved(req_id):
                    continue  # freed after its move was stored: the handle lives on the CPU tier
                tier.forget(req_id)
            self.kvplane_metrics.released.inc()
            if self.kvplane_agent is not None:
                # Freed before its expiry, and not by an early release: P read the blocks.
                read = not freed and int(time.time() * 1000) < held.expiry_unix_ms
                self.kvplane_agent.report_released(req_id, after_read=read)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Scheduler process, every step. Apply queued early releases: a held request's
        deadline is set in the past, and the workers free its blocks in this step.

        Never blocks, except for `idle_step_pause_s` in steps that schedule nothing and have no
        KV load in flight.
        """
        meta = super().build_connector_meta(scheduler_output)
        if self._served_alone:
            meta.reqs_in_batch.update(self._served_alone)
            self._served_alone = set()
        with self._release_lock:
            pending, self._pending_releases = self._pending_releases, []
            moves, self._pending_moves = self._pending_moves, []
            if self._drain_requested:
                self._drain_requested = False
                self._draining = True
                pending.extend(self._held)
                if self._host_tier is not None:
                    pending.extend(self._host_tier.moved_request_ids())
        applied: dict[str, int] = {}
        if self._host_tier is not None:
            pending = self._settle_host_tier(meta, pending, applied)
            self._move(moves)
        for req_id in pending:
            if req_id in self._held or req_id in self._prefill_held:
                meta.reqs_to_send[req_id] = meta.scheduler_clock - 1.0
                self.kvplane_metrics.early_releases.labels("applied").inc()
                applied[req_id] = self._held_blocks(req_id)
            else:
                # Already freed (read, expired) or never ours: nothing to do.
                self.kvplane_metrics.early_releases.labels("unknown").inc()
        self._snapshot_load(scheduler_output)
        self._update_demand(applied)
        pause = self.kvplane_settings.idle_step_pause_s
        if pause > 0 and not scheduler_output.total_num_scheduled_tokens and not self._pulled:
            # An idle step: only held blocks to watch (see idle_step_pause_s). A request whose KV
            # is being loaded (in _pulled from its allocation to its finish) is watched unpaused.
            self._pause(pause)
        return meta

    # ------------------------------------------------------------------ internals

    def _settle_host_tier(self, meta: Any, pending: list[str], applied: dict[str, int]) -> list[str]:
        """Scheduler thread, every step: the moves the control plane stored free their GPU
        blocks in this step (into `applied`, as blocks on their way); release commands naming
        moved handles, and moved handles the CPU tier dropped or that expired, end them.
        Returns the release commands left for held requests."""
        tier = self._host_tier
        assert tier is not None
        stored, refused = tier.settled()
        with self._release_lock:
            self._moving_blocks = tier.moving_blocks()
        for req_id in stored:
            self.kvplane_metrics.host_moves.labels("stored").inc()
            if req_id in self._held:
                meta.reqs_to_send[req_id] = meta.scheduler_clock - 1.0
                applied[req_id] = self._held_blocks(req_id)
        for _ in refused:
            self.kvplane_metrics.host_moves.labels("refused").inc()
        left = []
        for req_id in pending:
            if tier.release(req_id):
                self._end_moved(req_id, "released")
            else:
                left.append(req_id)
        for req_id in tier.ended(int(time.time() * 1000)):
            self._end_moved(req_id, "ended")
        return left

    def _end_moved(self, req_id: str, reason: str) -> None:
        self.kvplane_metrics.host_handles_ended.labels(reason).inc()
        if self.kvplane_agent is not None:
            self.kvplane_agent.report_released(req_id)

    def _move(self, request_ids: list[str]) -> None:
        """Scheduler thread: the moves the control plane asked for (MoveCommand), made as this
        engine makes its own when short (`_spill`)."""
        tier, agent = self._host_tier, self.kvplane_agent
        if tier is None or agent is None or self._draining or not request_ids:
            return
        for req_id in request_ids:
            moved = tier.move(req_id)
            if moved is not None:
                self.kvplane_metrics.host_moves.labels("sent").inc()
                agent.publish(moved, None, on_outcome=tier.outcome(req_id))
        with self._release_lock:
            self._moving_blocks = tier.moving_blocks()

    def _spill(self) -> None:
        """Scheduler thread, when requests wait for blocks: move the oldest handles the CPU tier
        holds, for what the demand lacks; the moves' blocks count as on their way."""
        tier, agent = self._host_tier, self.kvplane_agent
        if tier is None or agent is None or self._draining:
            return
        wanted = self._current_demand()
        if wanted > 0:
            for req_id, moved in tier.spill(wanted):
                self.kvplane_metrics.host_moves.labels("sent").inc()
                agent.publish(moved, None, on_outcome=tier.outcome(req_id))
        with self._release_lock:
            self._moving_blocks = tier.moving_blocks()

    def _after_finish(
        self, request: Request, delay_free: bool, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        pulled = self._pulled.pop(request.request_id, 0)
        self._pull_started.pop(request.request_id, None)
        took = self._pull_ms.pop(request.request_id, None)
        waited = self._queued_ms.pop(request.request_id, None)
        if params is not None and (request.kv_transfer_params or {}).get("do_remote_decode"):
            # P's own report of its pull, returned with its params: vLLM's usage counts pulled tokens
            # and prefix-cache hits alike as cached, and the gateway counts them apart. Tokens whose
            # load failed and were recomputed (kv_load_failure_policy) still count as pulled here.
            params[KEY_PULLED_TOKENS] = pulled
            if pulled and took is not None:
                params[KEY_PULL_MS] = round(took, 3)
            if waited is not None:
                params[KEY_QUEUED_MS] = round(waited, 3)
        if delay_free and params and params.get("do_remote_prefill"):
            # P side: the blocks wait for D's read. When the turn's D leg fails or is refused, the
            # control plane sends a release command for this request, applied as a handle's is.
            self._prefill_held.add(request.request_id)
            return params
        if not delay_free or not params or not params.get("do_remote_decode"):
            return params
        request_params = request.kv_transfer_params or {}
        if request_params.get(KEY_RETAIN) is False and not self._draining:
            # Routing found this turn's KV not worth keeping for the next one (P keeps the prompt,
            # and the output would not pay for a pull): freed at the next step like a P lease,
            # never published, and nothing is announced to the caller.
            self._prefill_held.add(request.request_id)
            self._queue_release(request.request_id)
            return None
        finished = self._handles.finished(
            params,
            request_params,
            request.all_token_ids,
            new_id=uuid.uuid4().hex,
            now_unix_s=time.time(),
            engine_clock_s=time.perf_counter(),
        )
        handle_id, retained_bytes, handle = finished.handle_id, finished.retained_bytes, finished.handle
        if self._draining:
            self._held[request.request_id] = _Held(handle_id, retained_bytes)
            self._queue_release(request.request_id)
            return params
        if finished.problem:
            log.warning("kvplane: not publishing %s: %s", request.request_id, finished.problem)
        if handle is None:
            # Not routed by kvplane (or no handle): the blocks follow vLLM's own rules only.
            return params
        self.kvplane_metrics.published.inc()
        if self.kvplane_agent is not None:
            attributes = {"kvplane.handle_id": handle_id, "kvplane.retained_bytes": retained_bytes}
            with request_span(self._tracer, "kvplane.publish", _trace_headers(request), **attributes):
                self.kvplane_agent.publish(handle, current_trace_context())
        if self._host_tier is not None:
            retained = request.all_token_ids[: int(params.get("remote_num_tokens") or 0)]
            self._host_tier.track(request.request_id, handle, retained, request.block_hashes)
        # Held only once its publish is queued: a reconcile on the agent's thread that sees the
        # request also sees its publish (queued, or sent and referenced), never frees it unsent.
        self._held[request.request_id] = _Held(handle_id, retained_bytes, handle.wall_expiry_unix_ms)
        return params

    def _update_demand(self, applied: dict[str, int]) -> None:
        """End of a schedule: what the waiting requests that got no blocks need beyond the free
        blocks (plus the watermark, plus a block when a running request found none)."""
        wanted = sum(self._asked.values()) + self.kvplane_settings.kv_free_watermark_blocks
        if self._running_short:
            wanted += 1
        self._asked.clear()
        self._running_short = False
        shortfall = max(0, wanted - self._load.free_kv_blocks) if wanted else 0
        with self._release_lock:
            self._freeing.update(applied)
            self._shortfall = shortfall
        self._spill()
        self.kvplane_metrics.kv_demand.set(shortfall)
        demand = self._current_demand()
        if demand != self._demand_notified:
            # Only changes wake the agent; it repeats a lasting demand on its own.
            self._demand_notified = demand
            if self.kvplane_agent is not None:
                self.kvplane_agent.notify_demand()

    def _snapshot_load(self, scheduler_output: SchedulerOutput) -> None:
        """Scheduler thread, every step: the load the agent reads (one atomic write)."""
        manager = getattr(self, "_kv_cache_manager", None)
        waiting = sum(self._asked.values())
        before, self._load = (
            self._load,
            _load_snapshot(manager, scheduler_output, self._held.values(), waiting),
        )
        if self._load.running_requests < before.running_requests and self.kvplane_agent is not None:
            # A request ended: routing hears the lighter load now, not at the next sample (a
            # conversation's next turn comes the moment its answer ends, and an idle D may take it).
            self.kvplane_agent.notify_load()

    @property
    def held_request_ids(self) -> frozenset[str]:
        """Requests whose published blocks this engine still holds (scheduler thread)."""
        return frozenset(self._held)


def _engine_node(connector: NixlConnector, vllm_config: VllmConfig) -> Node:
    """The node this engine registers as (its incarnation is the agent's to stamp)."""
    s = connector.kvplane_settings
    scheduler = connector.connector_scheduler
    return Node(
        node_id=s.node_id or f"{socket.gethostname()}-{connector.engine_id}",
        incarnation="",
        role=s.role,
        engine_id=str(connector.engine_id),
        http_url=s.http_url,
        side_channel_host=str(scheduler.side_channel_host),
        side_channel_port=int(scheduler.side_channel_port),
        fingerprint=Fingerprint(
            model=connector._model_name,
            kv_dtype=_kv_dtype(vllm_config),
            kv_layout=str(connector.get_required_kvcache_layout(vllm_config) or ""),
            extra=f"vllm-{vllm.__version__}",
        ),
        block_size=connector._block_size,
        kv_capacity_bytes=connector._bytes_per_block * connector._num_blocks,
        kv_bytes_per_token=connector._bytes_per_block // max(1, connector._block_size),
        dp_rank=int(vllm_config.parallel_config.data_parallel_index),
        tp_size=int(scheduler.transfer_tp_size),
        pp_size=int(vllm_config.parallel_config.pipeline_parallel_size),
        dcp_size=int(vllm_config.parallel_config.decode_context_parallel_size),
    )


def _load_snapshot(
    manager: Any, scheduler_output: SchedulerOutput, held: Iterable[_Held], waiting_kv_blocks: int = 0
) -> NodeLoad:
    """The engine's load after a schedule: running requests, free and total KV blocks (from vLLM's
    KV cache manager, when the scheduler has one), the bytes its published handles retain, and
    the blocks the waiting requests tried this step and given none need."""
    free = total = 0
    if manager is not None:
        pool = manager.block_pool
        free, total = int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)
    return NodeLoad(
        node_id="",
        incarnation="",
        running_requests=len(scheduler_output.num_scheduled_tokens or {}),
        free_kv_blocks=free,
        total_kv_blocks=total,
        retained_bytes=sum(h.retained_bytes for h in held),
        waiting_kv_blocks=waiting_kv_blocks,
    )


def _trace_headers(request: Request) -> Mapping[str, str] | None:
    """The request's W3C trace headers, kept by vLLM when its tracing is on."""
    headers: Mapping[str, str] | None = getattr(request, "trace_headers", None)
    return headers


def _log_through_vllm_handlers() -> None:
    """Send kvplane's log records where vLLM sends its own (engine processes configure only
    vLLM's logger; without this, kvplane's INFO lines from the engine core are lost)."""
    ours = logging.getLogger("kvplane")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if theirs.handlers:
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


@contextlib.contextmanager
def _nixl_agents_without_progress_thread() -> Iterator[None]:
    """While vLLM's worker builds its NIXL agent, build it without the progress thread.

    vLLM's worker module (0.32 and 0.33) calls its module-level `nixl_agent_config`; it is
    swapped for the duration of the worker's construction only.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.nixl_agent_config
    if original is None:  # NIXL is not installed; vLLM reports that itself
        yield
        return

    def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    base_worker.nixl_agent_config = without_progress_thread
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original


def _bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block id occupies across all layers of the transfer groups."""
    total = 0
    groups = getattr(kv_cache_config, "transfer_groups", None) or kv_cache_config.kv_cache_groups
    for group in groups:
        total += int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
    return total


def _served_model_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, list | tuple):
        name = name[0] if name else ""
    return str(name or vllm_config.model_config.model)


def _kv_dtype(vllm_config: VllmConfig) -> str:
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto":
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return dtype
