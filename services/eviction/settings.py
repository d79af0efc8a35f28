"""`eviction:` in the settings file: the coordinator's election, its sweeps and its retention policy."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class EvictionSection(BaseModel):
    """`eviction:` in the settings file (KVPLANE_EVICTION__<FIELD> in the environment)."""

    # The election key's name; replicas of one coordinator share it.
    election_name: str = "eviction"
    # This replica's id in the election; empty: host, pid and a random suffix.
    replica_id: str = ""
    # The leader's etcd lease TTL, seconds: a killed leader is replaced within it.
    lease_ttl_s: int = Field(10, ge=2, le=300)
    # How often policies are evaluated when nothing changes, seconds.
    evaluate_interval_s: float = Field(1.0, gt=0)
    # How often the leader sweeps for handles of unregistered nodes, seconds.
    orphan_sweep_interval_s: float = Field(10.0, gt=0)
    # Handles per tier in the order of moves to a node's host tier that the leader sends it
    # (least valuable first); the node takes the handles it leaves out oldest first.
    spill_order_max_handles: int = Field(64, ge=1, le=4096)
    # For this long after a leader's term starts, a release its policies decide for a node whose
    # command stream has not opened yet waits for it (the node may take moves), seconds: node
    # agents reconnect within their backoff (5 s at most, by default).
    move_grace_s: float = Field(10.0, ge=0)
    # A move a node started whose handle is still in its KV cache this long after is released
    # instead (the copy came to nothing), seconds.
    move_settle_s: float = Field(30.0, gt=0)
    # Release transactions in flight at once.
    release_concurrency: int = Field(16, ge=1, le=1024)
    # Conversations silent this long count as ended for the gap statistics, seconds.
    gap_horizon_s: float = Field(3600.0, gt=0)
    # Retention policy YAML (see kvplane.services.eviction.policy.pipeline);
    # `policy` inline wins over the file; neither: the built-in default.
    policy_file: str = ""
    policy: dict[str, Any] | None = None
