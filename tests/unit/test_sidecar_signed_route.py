"""The signed route: only the picker's, for this body, unexpired, is believed."""

from __future__ import annotations

import pytest

from kvplane.services.client import Endpoint, RouteResult
from kvplane.services.sidecar.signed_route import BadRoute, host_port, sign, verify
from kvplane.v1 import routing_pb2

KEY = b"k" * 32
ROUTE = RouteResult(
    route_id="r-1",
    decision="pull",
    reason="",
    prefill=Endpoint("p", "http://10.0.0.1:8100", "i1"),
    decode=Endpoint("d", "http://[::1]:8200", "i2"),
    prefill_params={"remote_block_ids": [1, 2], "kvplane_tenant": "acme"},
    expected_reused_tokens=0,
    response=routing_pb2.RouteResponse(),
    skip_decode_retention=True,
)


def test_where_to_report_the_answer_comes_through_signed() -> None:
    token = sign(
        KEY,
        ROUTE,
        body=b"{}",
        return_token_ids=True,
        expires_at=100.0,
        answer_to="http://10.0.0.3:9003",
        answer_id="a-7",
        keep_ids=True,
        collect_ids=False,
        prompt_known=True,
    )
    signed = verify(KEY, token, body=b"{}", now=99.0)
    assert (signed.answer_to, signed.answer_id, signed.keep_ids, signed.collect_ids, signed.prompt_known) == (
        "http://10.0.0.3:9003",
        "a-7",
        True,
        False,
        True,
    )
    # A route that names no endpoint: the picker reads D's answer itself.
    plain = verify(
        KEY, sign(KEY, ROUTE, body=b"{}", return_token_ids=False, expires_at=100.0), body=b"{}", now=1
    )
    assert plain.answer_to == "" and plain.collect_ids and not plain.prompt_known


def test_the_pickers_route_comes_through_whole() -> None:
    token = sign(KEY, ROUTE, body=b"{}", return_token_ids=True, expires_at=100.0)
    signed = verify(KEY, token, body=b"{}", now=99.0)
    assert signed.return_token_ids
    assert signed.route.prefill == ROUTE.prefill and signed.route.decode == ROUTE.decode
    assert signed.route.prefill_params == ROUTE.prefill_params
    assert (signed.route.route_id, signed.route.decision, signed.route.skip_decode_retention) == (
        "r-1",
        "pull",
        True,
    )


@pytest.mark.parametrize(
    ("key", "body", "now", "why"),
    [
        (b"another key", b"{}", 99.0, "signature"),
        (KEY, b'{"prompt": "other"}', 99.0, "another body"),
        (KEY, b"{}", 101.0, "expired"),
    ],
)
def test_a_route_is_refused_with_another_key_body_or_after_its_expiry(
    key: bytes, body: bytes, now: float, why: str
) -> None:
    token = sign(KEY, ROUTE, body=b"{}", return_token_ids=False, expires_at=100.0)
    with pytest.raises(BadRoute, match=why):
        verify(key, token, body=body, now=now)


def test_a_client_made_route_is_refused() -> None:
    token = sign(KEY, ROUTE, body=b"{}", return_token_ids=False, expires_at=100.0)
    payload, _, mac = token.partition(".")
    forged = sign(b"guess", ROUTE, body=b"{}", return_token_ids=False, expires_at=1e12).partition(".")[0]
    with pytest.raises(BadRoute):
        verify(KEY, f"{forged}.{mac}", body=b"{}", now=99.0)
    with pytest.raises(BadRoute):
        verify(KEY, "e30.AAAA", body=b"{}", now=99.0)
    assert payload


def test_host_port_spells_the_prefiller_as_llm_d_does() -> None:
    assert host_port("http://10.0.0.1:8100") == "10.0.0.1:8100"
    assert host_port("http://[::1]:8200/") == "[::1]:8200"
    assert host_port("https://p.example") == "p.example:443"


def test_without_a_key_no_route_is_signed_or_believed() -> None:
    with pytest.raises(ValueError):
        sign(b"", ROUTE, body=b"{}", return_token_ids=False, expires_at=100.0)
    forged = sign(b"x", ROUTE, body=b"{}", return_token_ids=False, expires_at=100.0)
    with pytest.raises(BadRoute, match="no route key"):
        verify(b"", forged, body=b"{}", now=0.0)
