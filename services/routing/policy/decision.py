"""Routing decisions and the reasons behind them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvplane.services.common.model.nodes import Node


class Decision(enum.Enum):
    """Pull the retained KV, recompute it, or prefill on its holder D, and why. Mirrors
    routing.proto's Decision."""

    PULL = "pull"
    # The prompt diverges from the handle after a verified prefix: pull that
    # prefix (clipped to it) and recompute the rest.
    PULL_PREFIX = "pull_prefix"
    RECOMPUTE_NO_HANDLE = "recompute_no_handle"
    RECOMPUTE_BELOW_THRESHOLD = "recompute_below_threshold"
    RECOMPUTE_EXPIRING = "recompute_expiring"
    RECOMPUTE_HOLDER_DOWN = "recompute_holder_down"
    RECOMPUTE_PREFIX_MISMATCH = "recompute_prefix_mismatch"
    RECOMPUTE_COST = "recompute_cost"
    # Set by the service, never by the policy: the check-out lost a race, or
    # etcd could not be reached to make it.
    RECOMPUTE_CONTENDED = "recompute_contended"
    # The holder D prefills the turn itself from the handle's blocks, with no P leg
    # (`decode_prefill.py`); only for callers that can run a turn on D alone.
    PREFILL_ON_DECODE = "prefill_on_decode"

    @property
    def pulls(self) -> bool:
        return self is Decision.PULL or self is Decision.PULL_PREFIX


@dataclass(frozen=True, slots=True)
class PullVerdict:
    """Pull or recompute, with the estimates that led there (ms, tokens).

    `reusable_tokens` is how much of the handle the prompt provably shares
    (a pull is clipped to it); `cached_tokens` what the chosen prefill node's
    own prefix cache is believed to hold. A pull moves only the difference.
    """

    decision: Decision
    reason: str
    reusable_tokens: int = 0
    transfer_ms: float = 0.0
    recompute_ms: float = 0.0
    life_left_ms: int = 0
    cached_tokens: int = 0

    @property
    def pulled_tokens(self) -> int:
        """Tokens of KV the pull is expected to move (0 for a recompute)."""
        return max(0, self.reusable_tokens - self.cached_tokens) if self.decision.pulls else 0


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The policy's answer for one turn."""

    prefill: Node
    decode: Node
    verdict: PullVerdict
    # Why the turn left its home prefill node (the one believed to hold the most of its prompt),
    # with both nodes' estimates; empty where it stayed, or no node held any of it.
    moved_from: str = ""

    @property
    def decision(self) -> Decision:
        return self.verdict.decision


class NoEligibleNodes(Exception):
    """No prefill or decode node passes the filters: the turn cannot be routed."""
