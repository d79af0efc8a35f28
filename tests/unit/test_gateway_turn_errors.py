"""How a turn ends early: each error carries what its catcher needs, and nothing else stands in for it."""

from __future__ import annotations

from kvplane.services.gateway.turn_errors import CLIENT_GONE, ClientGone, DecodeUnreachable, TurnFailed
from tests.support.gateway_parts import route

ROUTE = route("http://p0", "http://d0")


def test_a_failed_turn_carries_the_clients_status_message_and_the_engines_own_body() -> None:
    failed = TurnFailed(400, "prompt too long", b'{"error": {"code": 400}}')
    assert (failed.status, failed.message, failed.body, str(failed)) == (
        400,
        "prompt too long",
        b'{"error": {"code": 400}}',
        "prompt too long",
    )
    assert TurnFailed(503, "no engine").body == b"", "no engine body: the front writes its own"


def test_an_unreachable_decode_carries_the_route_to_avoid_and_ps_blocks_to_release() -> None:
    params = {"remote_engine_id": "p-engine", "remote_block_ids": [[1, 2]]}
    unreachable = DecodeUnreachable("decode leg: unreachable", ROUTE, params)
    assert unreachable.route is ROUTE and unreachable.route.decode.node_id == "d0"
    assert unreachable.prefill_params == params and str(unreachable) == "decode leg: unreachable"
    assert DecodeUnreachable("x", ROUTE).prefill_params is None, "P may not have answered"


def test_the_three_ends_are_distinct_so_that_no_handler_catches_anothers() -> None:
    kinds = (ClientGone, DecodeUnreachable, TurnFailed)
    for kind in kinds:
        assert issubclass(kind, Exception)
        assert not any(issubclass(kind, other) for other in kinds if other is not kind)
    assert CLIENT_GONE == "client_gone", "the outcome label of a leg whose client went away"
