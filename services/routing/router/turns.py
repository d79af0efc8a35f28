"""The `Router`'s inputs and outputs for one turn: domain values, no protobuf."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.store.records import HandleRecord
from kvplane.services.routing.policy import Decision, Prompt, RoutePlan


@dataclass(frozen=True, slots=True)
class AwaitedHandle:
    """The handle a caller saw the previous turn's decode engine announce (its id and tokens)."""

    handle_id: str
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn to route, validated, for the authenticated tenant."""

    tenant: str
    conversation: str
    model: str
    prompt: Prompt
    # What is left of the caller's deadline, seconds (None: no deadline).
    time_budget_s: float | None = None
    # Nodes the caller says failed this turn.
    failed_node_ids: frozenset[str] = frozenset()
    # The handle the previous turn's engine announced, which the turn may wait for.
    awaited: AwaitedHandle | None = None
    # The turn's bound on its output, if known (whether D keeps its KV: `policy.retention`).
    max_output_tokens: int | None = None
    # The cache_salt the turn's engine requests carry (None: unsalted): predicts P's block hashes.
    cache_salt: str | None = None
    # The caller can run the turn on its decode engine alone (PREFILL_ON_DECODE).
    prefill_on_decode_ok: bool = False


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    """The full result of one Route, before it becomes protobuf."""

    route_id: str
    plan: RoutePlan
    decision: Decision
    reason: str
    prefill_params: dict[str, Any]
    reused_tokens: int
    handle: CacheHandle | None
    # The checked-out handle as serialized protobuf (the claim's encoding, reused).
    handle_pb: bytes = b""
    # When the turn was routed, ms since the epoch.
    routed_unix_ms: int = 0
    # D need not keep this turn's KV for the next turn (`policy.retention`).
    skip_decode_retention: bool = False
    # The conversation's handle, when no later one will supersede it and P holds more than it
    # (D keeps nothing of this turn, and the handle was not checked out): to release.
    superseded: HandleRecord | None = None


@dataclass(frozen=True, slots=True)
class TurnReport:
    """What a caller reports of a finished turn (ms, tokens); the names are ReportTurn's."""

    success: bool
    prompt_tokens: int = 0
    pulled_tokens: int = 0
    # Prompt tokens P found in its own prefix cache (None: not reported).
    cached_tokens: int | None = None
    transfer_ms: float = 0.0
    # The P leg as the caller timed it: P's queue, its pull and its compute.
    prefill_ms: float = 0.0
    # How long the prompt waited on P besides its pull, as P measured it (None: not said).
    prefill_queued_ms: float | None = None
    ttft_ms: float = 0.0
    model: str = ""
    # D's finish-time kv_transfer_params and P's, as JSON ("" when absent).
    decode_kv_transfer_params_json: str = ""
    prefill_kv_transfer_params_json: str = ""
    prefill_node_id: str = ""
    # The tokens D retained, for a handle published from the report (no kvplane connector).
    retained_token_ids: Sequence[int] = ()
    # When the answer ended (D's request finished), Unix ms by the caller's clock (None: not said).
    ended_unix_ms: int | None = None
