"""What the gateway does when a step of a turn fails: the rules, apart from the I/O that applies them.

A turn is Route, the P leg, then the D leg. Each step can fail, and each failure says what can
help (`LegFailure`: the engine's status, whether anything answered):

- Routing refuses (`after_route_refusal`): a request routing rejects (invalid, no engine for its
  model) fails with the client's error; any other refusal, or routing unreachable, is served from
  the fallback engines as a recompute, and fails with 503 only when none are configured.
- The P leg fails (`prefill_retry`): a request P rejected (4xx) fails at once, since the same body
  would be rejected again; otherwise it is retried once without the handle (a stale or unreadable
  handle must never fail a user's turn). The retry goes to the same P after an answer (5xx: P is
  alive), and to another P after silence (refused, reset, timed out: P may be down): routing is
  asked again without it, or, for a turn routing did not place or could not place again, another
  fallback P (`retry_without_routing`).
- The D leg cannot be reached before anything reached the client (`after_decode_failure`): the
  turn is routed again without that D and run once more; a second failure, or any other, ends it.
- A leg that fails for good answers the client with the engine's own status for a request the
  engine rejected, and 502 otherwise (`client_status`).

Pure: no I/O and no clock reads.
"""

from __future__ import annotations

import enum
from typing import Protocol

# Decisions the gateway adds to routing's own ("pull", "recompute_no_handle", ...).
FALLBACK = "fallback"
RETRY_NO_HANDLE = "retry_no_handle"

# A turn runs at most twice: once as routed, once more after its D could not be reached.
MAX_ATTEMPTS = 2

# The status of a turn that routing cannot place and no fallback engine can serve.
NO_ENGINE_STATUS = 503
# The status of a leg that failed without the engine rejecting the request.
BAD_GATEWAY = 502


class LegFailure(Protocol):
    """What a failed engine leg says about itself (`legs.LegFailed`)."""

    @property
    def status(self) -> int:
        """The engine's HTTP status; 0 when it answered nothing."""
        ...

    @property
    def unreachable(self) -> bool:
        """Nothing answered: a refused or reset connection."""
        ...

    @property
    def outcome(self) -> str:
        """ "unreachable", "http_<status>", "timeout" or "error"."""
        ...


def rejected_by_engine(status: int) -> bool:
    """A client error (4xx) is the request's fault: retrying it would fail the same way."""
    return 400 <= status < 500


def client_status(failure: LegFailure) -> int:
    """The status the client gets for a leg that failed for good: the engine's own for a request
    it rejected, 502 for anything else (an engine error, a timeout, silence)."""
    return failure.status if rejected_by_engine(failure.status) else BAD_GATEWAY


def engine_may_be_down(failure: LegFailure) -> bool:
    """Silence (refused, reset or timed out), unlike an answer, says the engine itself may be gone:
    it is marked suspect and a retry avoids it."""
    return failure.unreachable or failure.outcome == "timeout"


class PrefillRetry(enum.Enum):
    """Where a turn goes after its P leg failed."""

    # P rejected the request itself: the turn fails with P's answer.
    GIVE_UP = "give_up"
    # P answered with an error: once more on the same P, without the handle.
    SAME_ENGINE = "same_engine"
    # P was silent: routing is asked again, naming P as failed.
    REROUTE = "reroute"
    # P was silent and routing cannot help: another fallback P.
    OTHER_FALLBACK = "other_fallback"


def prefill_retry(failure: LegFailure, *, routed: bool) -> PrefillRetry:
    """The P leg's one retry, by what its failure says; `routed`: routing placed the turn (its
    decision is not `FALLBACK`)."""
    if rejected_by_engine(failure.status):
        return PrefillRetry.GIVE_UP
    if not engine_may_be_down(failure):
        return PrefillRetry.SAME_ENGINE
    return PrefillRetry.REROUTE if routed else PrefillRetry.OTHER_FALLBACK


def retry_without_routing(*, fallback_configured: bool) -> PrefillRetry:
    """Where a P retry goes when routing could not place it again: another fallback P, or, with
    none configured, the same P (it may be back, and the turn must not fail on a guess)."""
    return PrefillRetry.OTHER_FALLBACK if fallback_configured else PrefillRetry.SAME_ENGINE


class DecodeNext(enum.Enum):
    """What follows a failed D leg."""

    # Route the turn again without that D, and run it once more.
    REROUTE = "reroute"
    # The turn fails with `client_status`.
    GIVE_UP = "give_up"


def after_decode_failure(failure: LegFailure, *, attempt: int) -> DecodeNext:
    """A D that could not be reached (nothing has been sent to the client yet) is routed around
    while the turn has an attempt left; any other failure ends the turn. `attempt` counts from 1."""
    if failure.unreachable and attempt < MAX_ATTEMPTS:
        return DecodeNext.REROUTE
    return DecodeNext.GIVE_UP


class RouteRefusal(enum.Enum):
    """What follows a Route that routing refused (by gRPC status code name)."""

    # The request is invalid: 400, routing's message.
    INVALID_REQUEST = "invalid_request"
    # No engine serves the request's model: 404, this request's error alone.
    UNKNOWN_MODEL = "unknown_model"
    # The gateway's own credentials were refused: every turn is affected; served from the
    # fallback engines, and logged.
    CREDENTIALS_REFUSED = "credentials_refused"
    # Anything else (deadline, internal, unavailable): served from the fallback engines.
    FALLBACK = "fallback"


def after_route_refusal(code: str) -> RouteRefusal:
    """The refusal's kind from its gRPC status code name ("INVALID_ARGUMENT", ...): only the
    request's own faults fail the turn; routing's trouble must not."""
    if code == "INVALID_ARGUMENT":
        return RouteRefusal.INVALID_REQUEST
    if code == "NOT_FOUND":
        return RouteRefusal.UNKNOWN_MODEL
    if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return RouteRefusal.CREDENTIALS_REFUSED
    return RouteRefusal.FALLBACK
