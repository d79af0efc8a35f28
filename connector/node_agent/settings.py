"""The node agent's settings, its misuse error, and the snapshot of its counters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvplane.services.client.credentials import ClientCredentials


class NodeAgentError(Exception):
    """Misuse of the node agent (for example starting it twice)."""


@dataclass(frozen=True, slots=True)
class NodeAgentSettings:
    """How the agent reaches the control plane and how hard it tries."""

    # host:port of the metadata service.
    metadata_target: str
    # host:port of the eviction service; empty: the metadata target (`kvplane serve all`).
    eviction_target: str = ""
    # Lease time-to-live requested at registration, in seconds (2 to 300). Long enough to outlive
    # a control-plane restart: a dead engine is avoided at once anyway (suspect marks).
    lease_ttl_s: int = 30
    # Seconds between samples of the engine's load: a change is reported this soon, and load
    # reports are never closer together than this.
    load_interval_s: float = 0.5
    # Longest gap between two load reports while the load does not change, in seconds.
    load_heartbeat_s: float = 10.0
    # Most items one PublishHandles or ReportReleased call carries.
    batch_max: int = 64
    # Items the queue holds; beyond that the oldest is dropped and counted.
    queue_max: int = 4096
    # Deadline of one unary call, in seconds.
    rpc_timeout_s: float = 2.0
    # First and largest retry delay, in seconds (exponential, full jitter).
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    # Command ids remembered for at-most-once application.
    seen_commands_max: int = 8192
    # On stop(): seconds spent flushing the queue and deregistering.
    stop_flush_s: float = 1.0
    # Seconds between repeats of a KV demand that lasts (a lost or ignored report is re-sent).
    demand_refresh_s: float = 0.5
    # Whether stop() deregisters the node (its handles are then purged at once).
    deregister_on_stop: bool = True
    # Seconds a publish may keep failing before it is given up and its blocks freed.
    publish_give_up_s: float = 30.0
    # Bearer token for the control plane (shorthand for credentials.token).
    auth_token: str = dataclasses.field(default="", repr=False)
    # Token, TLS and mesh secret presented to the control plane (kvplane.services.client.credentials).
    credentials: ClientCredentials = dataclasses.field(default_factory=ClientCredentials)

    def __post_init__(self) -> None:
        if not self.metadata_target:
            raise ValueError("metadata_target is required")
        if not 2 <= self.lease_ttl_s <= 300:
            raise ValueError("lease_ttl_s must be within 2..300")
        if self.batch_max < 1 or self.queue_max < 1 or self.seen_commands_max < 1:
            raise ValueError("batch_max, queue_max and seen_commands_max must be positive")
        if self.load_interval_s <= 0 or self.rpc_timeout_s <= 0 or self.demand_refresh_s <= 0:
            raise ValueError("load_interval_s, rpc_timeout_s and demand_refresh_s must be positive")
        if self.load_heartbeat_s < self.load_interval_s:
            raise ValueError("load_heartbeat_s must be at least load_interval_s")
        if self.publish_give_up_s <= 0:
            raise ValueError("publish_give_up_s must be positive")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


@dataclass(frozen=True, slots=True)
class AgentStats:
    """A snapshot of the agent's counters."""

    registered: bool
    registrations: int
    published: int
    released_reported: int
    dropped: int
    queued: int
    load_reports: int
    commands_applied: int
    commands_duplicate: int
    demand_reports: int
    command_streams_opened: int
    rpc_errors: int
    # Retained handles freed because nothing referenced them at a (re)registration.
    reconciled_freed: int = 0
    # Publishes given up (failing past publish_give_up_s, or expired), their blocks freed.
    publishes_given_up: int = 0
