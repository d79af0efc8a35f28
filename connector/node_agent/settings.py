"""The node agent's settings, its misuse error, and the snapshot of its counters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvplane.services.client.credentials import ClientCredentials

# Seconds between repeats of a KV demand that lasts (the simulator's decode nodes repeat theirs
# as often).
DEFAULT_DEMAND_REFRESH_S = 0.5


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
    demand_refresh_s: float = DEFAULT_DEMAND_REFRESH_S
    # Whether stop() deregisters the node (its handles are then purged at once).
    deregister_on_stop: bool = True
    # Seconds a publish may keep failing before it is given up and its blocks freed.
    publish_give_up_s: float = 30.0
    # Seconds a report of blocks P read waits for a publish to go with (one etcd transaction for
    # both: a pulled turn's freed history and the turn's new handle); 0: sent at once. Longer
    # than a turn's decode on this engine, so that the turn's publish finds the report waiting.
    # Any other free is reported at once (`NodeAgent.report_released`).
    release_linger_s: float = 5.0
    # host:port of every routing replica the engine's load, and its prefix cache (its KV-cache
    # events, when the agent is given a source), are streamed to; empty: the load goes to etcd
    # alone and events are read but not forwarded.
    routing_targets: tuple[str, ...] = ()
    # Shortest interval between two prefix-cache deltas to one replica, in seconds.
    prefix_cache_interval_s: float = 0.1
    # Longest interval between two prefix-cache messages while nothing changes, in seconds
    # (routing's staleness bound, routing.prefix_cache_stale_after_s, must be well above it).
    # Each keep-alive wakes every routing replica: at 0.5 s, four idle engines cost a replica
    # 2.5 ms of CPU a second more than at 2 s.
    prefix_cache_keepalive_s: float = 2.0
    # Send only blocks at every k-th depth of their chain (1: every block): k times less memory
    # and traffic at routing, prefixes matched to k blocks.
    prefix_cache_checkpoint_blocks: int = 1
    # Blocks the agent's view of its engine's cache holds at most (beyond: missed removals; reset).
    prefix_cache_max_blocks: int = 4_000_000
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
        if self.release_linger_s < 0:
            raise ValueError("release_linger_s must not be negative")
        if not 0 < self.prefix_cache_interval_s <= self.prefix_cache_keepalive_s:
            raise ValueError("need 0 < prefix_cache_interval_s <= prefix_cache_keepalive_s")
        if self.prefix_cache_checkpoint_blocks < 1 or self.prefix_cache_max_blocks < 1:
            raise ValueError("prefix_cache_checkpoint_blocks and prefix_cache_max_blocks must be positive")
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
    # Relocations (a handle moved to another tier) refused: the handle was no longer retained.
    relocations_refused: int = 0
    # Publishes refused because their blocks were freed or left retention already (late or
    # re-sent), the blocks freed here.
    publishes_refused_freed: int = 0
    # Spill orders handed to the engine (an engine with a host tier).
    spill_orders: int = 0
    # The engine's KV-cache events (all 0 without a source): batches and events read, events of
    # an unknown type, gaps filled by replay, resets of the block set (AllBlocksCleared, a gap
    # that could not be filled, an engine restart, an overflow), engine restarts seen, blocks
    # held now, and prefix-cache messages sent to routing replicas.
    kv_event_batches: int = 0
    kv_events: int = 0
    kv_unknown_events: int = 0
    kv_gaps_filled: int = 0
    kv_resets: int = 0
    kv_restarts: int = 0
    kv_blocks: int = 0
    prefix_cache_messages: int = 0
