"""A turn's P leg on its own, against scripted engines over loopback HTTP: what P is asked, what its
answer tells the turn, and the one retry without the handle (same P after an error answer, another P
after silence, none after P rejected the request)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvplane.services.client import RoutingUnavailable
from kvplane.services.gateway import failover
from kvplane.services.gateway.prefill_leg import PrefillLeg
from kvplane.services.gateway.progress import TurnProgress
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.routing_step import RoutingStep, fresh_params
from kvplane.services.gateway.suspects import engine_key
from kvplane.services.gateway.turn_errors import TurnFailed
from tests.integration.test_gateway_front import P_PARAMS, ScriptedEngine
from tests.support.gateway_parts import (
    CHAT,
    P_ROUTE_PARAMS,
    Parts,
    fallback_engines,
    parts,
    reported,
    route,
    turn,
)

PROMPT = RoutedPrompt(tokens=3, token_ids=(1, 2, 3))
D_URL = "http://127.0.0.1:9"  # never called by a P leg


@pytest.fixture
async def engines() -> AsyncIterator[tuple[ScriptedEngine, ScriptedEngine]]:
    a, b = ScriptedEngine("prefill"), ScriptedEngine("prefill")
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def leg(p: Parts, session: aiohttp.ClientSession) -> PrefillLeg:
    routing = RoutingStep(p.routing, fallback_engines(p), p.reporter, p.metrics)  # type: ignore[arg-type]
    return PrefillLeg(p.settings, session, routing, p.reporter, p.metrics, p.tracer)


def _posts(engine: ScriptedEngine) -> list[dict[str, object]]:
    return [body for path, body, _ in engine.seen if path.startswith("/v1/")]


async def test_p_is_asked_for_one_token_with_routings_params_and_answers_with_ds(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, _ = engines
    p = parts()
    progress = TurnProgress("pull")
    # The client asking for token ids is D's to answer, not P's.
    client_turn = turn(stream=True, body={**CHAT, "return_token_ids": True})
    answer = await leg(p, session).once(client_turn, route(a.url, D_URL), progress)
    assert answer["kv_transfer_params"] == P_PARAMS and progress.prefill_params == P_PARAMS
    [(path, body, _)] = a.seen
    assert path == "/v1/chat/completions" and body["max_tokens"] == 1 and body["stream"] is False
    assert "return_token_ids" not in body and body["kv_transfer_params"] == P_ROUTE_PARAMS
    assert body["messages"] == turn().body["messages"]
    assert progress.sources is not None and progress.prefill_s > 0
    assert p.leg_count("prefill", "ok") == 1


async def test_a_request_p_rejects_fails_the_turn_with_ps_answer_and_no_retry(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, _ = engines
    a.failures = [400]
    p = parts()
    with pytest.raises(TurnFailed) as failed:
        await leg(p, session).run(turn(), PROMPT, route(a.url, D_URL), TurnProgress("pull"))
    assert failed.value.status == 400 and b"scripted 400" in failed.value.body
    assert len(_posts(a)) == 1, "the same body would be rejected again"
    [report] = await reported(p, 1)
    assert report["success"] is False and "HTTP 400" in report["error"]
    assert p.metric("kvplane_gateway_turns_total", decision="pull", outcome="failed") == 1


async def test_an_error_answer_is_retried_once_on_the_same_p_without_the_handle(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, _ = engines
    a.failures = [500]
    p = parts()
    progress = TurnProgress("pull")
    answer, retry = await leg(p, session).run(turn(), PROMPT, route(a.url, D_URL), progress)
    assert answer["kv_transfer_params"] == P_PARAMS
    assert retry.route_id == "" and retry.decision == progress.decision == failover.RETRY_NO_HANDLE
    assert retry.prefill.http_url == a.url and retry.prefill_params == fresh_params(turn().identity)
    first, second = _posts(a)
    assert first["kv_transfer_params"] == P_ROUTE_PARAMS
    assert second["kv_transfer_params"] == fresh_params(turn().identity), "no handle the second time"
    assert p.metric("kvplane_gateway_retries_total", reason="prefill_http_500") == 1
    [spent] = await reported(p, 1)
    assert spent["route"].route_id == "r1" and spent["success"] is False, "routing learns the route failed"


async def test_a_silent_p_is_avoided_by_asking_routing_again_naming_it(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, b = engines
    a.drop_next = 1
    p = parts(fallback_prefill_url=[a.url], fallback_decode_url=[D_URL])
    p.routing.routes.append(route(b.url, D_URL, route_id="r2", prefill_id="p1"))
    part = leg(p, session)
    answer, retry = await part.run(turn(), PROMPT, route(a.url, D_URL), TurnProgress("pull"))
    assert answer["kv_transfer_params"] == P_PARAMS and retry.prefill.http_url == b.url
    assert p.routing.asked[0]["failed_node_ids"] == ("p0",)
    assert len(_posts(a)) == 1 and len(_posts(b)) == 1
    assert engine_key(a.url) in part.routing.fallback.suspects.current(time.monotonic()), "P is suspect"


async def test_a_silent_p_of_a_fallback_turn_is_retried_on_another_fallback_p(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, b = engines
    a.drop_next = 1
    p = parts(fallback_prefill_url=[a.url, b.url], fallback_decode_url=[D_URL])
    fallback = route(a.url, D_URL, route_id="", decision=failover.FALLBACK)
    _, retry = await leg(p, session).run(turn(), PROMPT, fallback, TurnProgress(failover.FALLBACK))
    assert retry.prefill.http_url == b.url and retry.prefill.node_id == "fallback-prefill"
    assert p.routing.asked == [], "routing did not place the turn: it is not asked"
    assert p.routing.reports == [], "no route was checked out"


async def test_when_routing_cannot_place_the_retry_and_no_fallback_exists_the_same_p_is_tried_again(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, _ = engines
    a.drop_next = 1
    p = parts()
    p.routing.routes.append(RoutingUnavailable("down"))
    _, retry = await leg(p, session).run(turn(), PROMPT, route(a.url, D_URL), TurnProgress("pull"))
    assert retry.prefill.http_url == a.url and len(_posts(a)) == 2


async def test_a_p_that_fails_twice_fails_the_turn_with_a_bad_gateway(
    engines: tuple[ScriptedEngine, ScriptedEngine], session: aiohttp.ClientSession
) -> None:
    a, _ = engines
    a.failures = [500, 503]
    p = parts()
    with pytest.raises(TurnFailed) as failed:
        await leg(p, session).run(turn(), PROMPT, route(a.url, D_URL), TurnProgress("pull"))
    assert failed.value.status == failover.BAD_GATEWAY and "prefill failed twice" in failed.value.message
    assert p.metric("kvplane_gateway_turns_total", decision=failover.RETRY_NO_HANDLE, outcome="failed") == 1
