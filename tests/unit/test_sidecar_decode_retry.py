"""The sidecar's answer when its decode engine fails: Envoy may retry elsewhere only on the first
attempt, and only when nothing answered (the gateway's `failover.after_decode_failure`)."""

from __future__ import annotations

import json

from aiohttp.test_utils import make_mocked_request

from kvplane.services.epp.destinations import ATTEMPT_HEADER, RETRY_ELSEWHERE
from kvplane.services.gateway.legs import LegFailed
from kvplane.services.sidecar.app import _decode_failed


def request(attempt: str | None = None):
    headers = {ATTEMPT_HEADER: attempt} if attempt is not None else {}
    return make_mocked_request("POST", "/v1/completions", headers=headers)


UNREACHABLE = LegFailed("decode", "unreachable: refused", unreachable=True)


def test_an_unreachable_decode_engine_on_the_first_attempt_asks_envoy_for_another_pod() -> None:
    for attempt in (None, "1"):
        response = _decode_failed(request(attempt), UNREACHABLE, None)
        assert response.status == 503
        assert response.headers[RETRY_ELSEWHERE] == "unreachable"


def test_the_second_attempt_fails_the_turn_as_the_gateway_does() -> None:
    response = _decode_failed(request("2"), UNREACHABLE, None)
    assert response.status == 502 and RETRY_ELSEWHERE not in response.headers


def test_an_engine_that_answered_is_never_retried_elsewhere() -> None:
    rejected = LegFailed("decode", "HTTP 400", status=400, body=b'{"error": {"message": "bad"}}')
    response = _decode_failed(request(), rejected, None)
    assert response.status == 400 and RETRY_ELSEWHERE not in response.headers
    assert json.loads(response.body)["error"]["message"] == "bad"
    failed = LegFailed("decode", "HTTP 500", status=500)
    assert _decode_failed(request(), failed, None).status == 502


def test_a_malformed_attempt_count_counts_as_the_first() -> None:
    assert _decode_failed(request("x"), UNREACHABLE, None).status == 503
