"""The gateway's failover rules: what a turn does when Route, its P leg or its D leg fails."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvplane.services.gateway import failover
from kvplane.services.gateway.failover import DecodeNext, PrefillRetry, RouteRefusal
from kvplane.services.gateway.legs import LegFailed


@dataclass(frozen=True)
class Failure:
    status: int = 0
    unreachable: bool = False
    outcome: str = "error"


ANSWERED_500 = Failure(status=500, outcome="http_500")
REJECTED_400 = Failure(status=400, outcome="http_400")
REFUSED = Failure(unreachable=True, outcome="unreachable")
TIMED_OUT = Failure(outcome="timeout")


def test_a_request_the_prefill_engine_rejected_is_not_retried() -> None:
    for status in (400, 404, 413, 422, 499):
        failure = Failure(status=status, outcome=f"http_{status}")
        assert failover.prefill_retry(failure, routed=True) is PrefillRetry.GIVE_UP
        assert failover.prefill_retry(failure, routed=False) is PrefillRetry.GIVE_UP


def test_a_prefill_engine_that_answered_with_an_error_is_retried_once_on_the_same_engine() -> None:
    assert failover.prefill_retry(ANSWERED_500, routed=True) is PrefillRetry.SAME_ENGINE
    assert failover.prefill_retry(ANSWERED_500, routed=False) is PrefillRetry.SAME_ENGINE
    # An error without any status (a broken answer) is no sign that the engine is down either.
    assert failover.prefill_retry(Failure(), routed=True) is PrefillRetry.SAME_ENGINE


def test_a_silent_prefill_engine_of_a_routed_turn_is_routed_around() -> None:
    assert failover.prefill_retry(REFUSED, routed=True) is PrefillRetry.REROUTE
    assert failover.prefill_retry(TIMED_OUT, routed=True) is PrefillRetry.REROUTE


def test_a_silent_prefill_engine_of_a_fallback_turn_is_replaced_by_another_fallback_engine() -> None:
    assert failover.prefill_retry(REFUSED, routed=False) is PrefillRetry.OTHER_FALLBACK
    assert failover.prefill_retry(TIMED_OUT, routed=False) is PrefillRetry.OTHER_FALLBACK


def test_a_retry_routing_cannot_place_goes_to_another_fallback_engine_or_else_the_same() -> None:
    assert failover.retry_without_routing(fallback_configured=True) is PrefillRetry.OTHER_FALLBACK
    assert failover.retry_without_routing(fallback_configured=False) is PrefillRetry.SAME_ENGINE


def test_only_silence_marks_an_engine_suspect() -> None:
    assert failover.engine_may_be_down(REFUSED)
    assert failover.engine_may_be_down(TIMED_OUT)
    assert not failover.engine_may_be_down(ANSWERED_500)
    assert not failover.engine_may_be_down(REJECTED_400)


def test_an_unreachable_decode_engine_is_routed_around_while_the_turn_has_an_attempt_left() -> None:
    assert failover.after_decode_failure(REFUSED, attempt=1) is DecodeNext.REROUTE
    assert failover.after_decode_failure(REFUSED, attempt=failover.MAX_ATTEMPTS) is DecodeNext.GIVE_UP


def test_a_decode_engine_that_answered_or_timed_out_ends_the_turn() -> None:
    for failure in (ANSWERED_500, REJECTED_400, TIMED_OUT):
        assert failover.after_decode_failure(failure, attempt=1) is DecodeNext.GIVE_UP


def test_the_client_gets_the_engines_status_for_a_rejected_request_and_502_otherwise() -> None:
    assert failover.client_status(REJECTED_400) == 400
    assert failover.client_status(Failure(status=422)) == 422
    assert failover.client_status(ANSWERED_500) == 502
    assert failover.client_status(Failure(status=503)) == 502
    assert failover.client_status(REFUSED) == 502
    assert failover.client_status(TIMED_OUT) == 502


@pytest.mark.parametrize(
    ("code", "refusal"),
    [
        ("INVALID_ARGUMENT", RouteRefusal.INVALID_REQUEST),
        ("NOT_FOUND", RouteRefusal.UNKNOWN_MODEL),
        ("UNAUTHENTICATED", RouteRefusal.CREDENTIALS_REFUSED),
        ("PERMISSION_DENIED", RouteRefusal.CREDENTIALS_REFUSED),
        ("DEADLINE_EXCEEDED", RouteRefusal.FALLBACK),
        ("UNAVAILABLE", RouteRefusal.FALLBACK),
        ("INTERNAL", RouteRefusal.FALLBACK),
        ("RESOURCE_EXHAUSTED", RouteRefusal.FALLBACK),
    ],
)
def test_only_the_requests_own_faults_refused_by_routing_fail_the_turn(
    code: str, refusal: RouteRefusal
) -> None:
    assert failover.after_route_refusal(code) is refusal


def test_the_engine_legs_failures_are_what_the_rules_read() -> None:
    """`legs.LegFailed` carries what the rules read, spelt as they read it."""
    assert failover.prefill_retry(LegFailed("prefill", "unreachable: x", unreachable=True), routed=True) is (
        PrefillRetry.REROUTE
    )
    assert (
        failover.prefill_retry(LegFailed("prefill", "timed out after 5 s"), routed=True)
        is PrefillRetry.REROUTE
    )
    rejected = LegFailed("prefill", "HTTP 400", status=400, body=b"{}")
    assert failover.prefill_retry(rejected, routed=True) is PrefillRetry.GIVE_UP
    assert failover.client_status(rejected) == 400
