"""A turn's Route step on its own, with a scripted routing client: routing's choice, the fallback
engines while routing cannot choose, and which refusals fail the turn instead."""

from __future__ import annotations

import grpc
import pytest

from kvplane.services.client import RoutingUnavailable
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_TENANT
from kvplane.services.gateway import failover
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.routing_step import RoutingStep, fresh_params
from kvplane.services.gateway.turn_errors import TurnFailed
from tests.support.gateway_parts import Parts, fallback_engines, parts, route, rpc_error, turn

P_URLS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
D_URLS = ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
PROMPT = RoutedPrompt(tokens=3, token_ids=(1, 2, 3))


def step(p: Parts) -> RoutingStep:
    return RoutingStep(p.routing, fallback_engines(p), p.reporter, p.metrics)  # type: ignore[arg-type]


@pytest.fixture
def with_fallback() -> Parts:
    return parts(fallback_prefill_url=P_URLS, fallback_decode_url=D_URLS)


async def test_routings_route_is_the_turns_and_routing_hears_the_whole_request(with_fallback: Parts) -> None:
    p = with_fallback
    routed = route("http://p", "http://d")
    p.routing.routes.append(routed)
    p.reporter.announce(turn(), {"kvplane_handle_id": "h-last", "remote_num_tokens": 42})
    assert await step(p).route(turn(), PROMPT, failed=("d9",)) is routed
    [asked] = p.routing.asked
    assert asked["conversation"] == "c1" and asked["model"] == "m" and asked["tenant"] == "acme"
    assert asked["prompt_tokens"] == 3 and asked["prompt_token_ids"] == (1, 2, 3)
    assert asked["failed_node_ids"] == ("d9",) and asked["max_output_tokens"] == 5
    assert (asked["awaited_handle_id"], asked["awaited_handle_tokens"]) == ("h-last", 42), (
        "the last turn's handle"
    )
    assert p.leg_count("route", "ok") == 1


@pytest.mark.parametrize(
    "refusal",
    [
        RoutingUnavailable("no replica answered"),
        rpc_error(grpc.StatusCode.UNAVAILABLE, "etcd down"),
        rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED),
        rpc_error(grpc.StatusCode.UNAUTHENTICATED, "bad token"),
    ],
    ids=["unreachable", "unavailable", "deadline", "credentials refused"],
)
async def test_while_routing_cannot_place_the_turn_the_fallback_engines_recompute_it(
    with_fallback: Parts, refusal: Exception
) -> None:
    p = with_fallback
    p.routing.routes.append(refusal)
    fallback = await step(p).route(turn(), PROMPT)
    assert (
        fallback.decision == failover.FALLBACK
        and fallback.route_id == ""
        and fallback.expected_reused_tokens == 0
    )
    assert fallback.prefill.http_url in P_URLS and fallback.decode.http_url in D_URLS
    assert fallback.reason.startswith("routing unavailable: ")
    assert fallback.prefill_params == fresh_params(turn().identity)
    assert p.metric("kvplane_gateway_retries_total", reason="routing_unavailable") == 1


async def test_the_fallback_avoids_the_engines_that_just_failed_the_turn(with_fallback: Parts) -> None:
    p = with_fallback
    p.routing.routes.append(RoutingUnavailable("down"))
    fallback = await step(p).route(turn(), PROMPT, avoid_urls=(P_URLS[0], D_URLS[0]))
    assert (fallback.prefill.http_url, fallback.decode.http_url) == (P_URLS[1], D_URLS[1])


@pytest.mark.parametrize(
    ("code", "status"),
    [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404)],
)
async def test_a_request_routing_rejects_fails_with_the_clients_error_not_a_fallback(
    with_fallback: Parts, code: grpc.StatusCode, status: int
) -> None:
    p = with_fallback
    p.routing.routes.append(rpc_error(code, "no engine serves model m"))
    with pytest.raises(TurnFailed) as failed:
        await step(p).route(turn(), PROMPT)
    assert failed.value.status == status and "no engine serves model m" in failed.value.message
    assert p.leg_count("route", code.name.lower()) == 1
    assert p.metric("kvplane_gateway_retries_total", reason="routing_unavailable") == 0


async def test_without_fallback_engines_an_unplaceable_turn_is_a_503_that_names_no_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p = parts()
    p.routing.routes.append(RoutingUnavailable("no replica answered (10.0.3.7:50051 went silent)"))
    with pytest.raises(TurnFailed) as failed:
        await step(p).route(turn(), PROMPT)
    assert failed.value.status == failover.NO_ENGINE_STATUS == 503
    assert "no fallback engines are configured" in failed.value.message
    # The routing replica's address is the operator's to see, in the log; never the client's.
    assert "10.0.3.7" not in failed.value.message
    assert any("10.0.3.7:50051" in r.getMessage() for r in caplog.records)


def test_fallback_params_are_turn_ones_with_kvplanes_keys_so_d_still_publishes() -> None:
    params = fresh_params(turn().identity)
    assert params["do_remote_decode"] is True and params["remote_engine_id"] is None
    assert (params[KEY_TENANT], params[KEY_CONVERSATION]) == ("acme", "c1")
    assert fresh_params(turn().identity) is not params, "a fresh dict each time"
