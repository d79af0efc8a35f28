"""A turn's D leg on its own, against a scripted engine over loopback HTTP: D's answer whole or
streamed event by event to the client, D's handle announced for the next turn, and what a D that
cannot be reached, rejects the request, or breaks off midway does to the turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvplane.services.common.model.handles import KEY_HANDLE_ID
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.gateway import legs
from kvplane.services.gateway.decode_leg import CONVERSATION_HEADER, DECISION_HEADER, ROUTE_HEADER, DecodeLeg
from kvplane.services.gateway.progress import TurnProgress
from kvplane.services.gateway.turn_errors import DecodeUnreachable, TurnFailed
from tests.integration.test_gateway_front import D_HANDLE, P_PARAMS, ScriptedEngine
from tests.support.gateway_parts import Parts, parts, reported, route, turn
from tests.support.polling import until

P_URL = "http://127.0.0.1:9"  # never called by a D leg
P_ANSWER = {"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS}
HANDLE = {**D_HANDLE, KEY_HANDLE_ID: "h-next"}


@pytest.fixture
async def decode() -> AsyncIterator[ScriptedEngine]:
    engine = ScriptedEngine("decode", handle=dict(HANDLE))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def leg(p: Parts, session: aiohttp.ClientSession) -> DecodeLeg:
    return DecodeLeg(p.settings, session, p.reporter, p.metrics, p.tracer)


def _posts(engine: ScriptedEngine) -> list[dict[str, Any]]:
    return [body for path, body, _ in engine.seen if path.startswith("/v1/")]


# --- whole answers ---------------------------------------------------------------------------------


async def test_ds_whole_answer_reaches_the_client_with_the_turns_headers(
    decode: ScriptedEngine, session: aiohttp.ClientSession
) -> None:
    p = parts()
    progress = TurnProgress("pull")
    response = await leg(p, session).whole(turn(), route(P_URL, decode.url), P_ANSWER, progress, attempt=1)
    assert isinstance(response, web.Response) and response.status == 200
    assert response.headers[DECISION_HEADER] == "pull" and response.headers[ROUTE_HEADER] == "r1"
    assert response.headers[CONVERSATION_HEADER] == "c1"
    assert response.body is not None
    answer = json.loads(bytes(response.body))
    assert answer["choices"][0]["finish_reason"] == "tool_calls" and "kv_transfer_params" not in answer
    [body] = _posts(decode)
    assert body["kv_transfer_params"]["remote_engine_id"] == P_PARAMS["remote_engine_id"], (
        "D reads P's blocks"
    )
    assert progress.decode_params is not None and progress.decode_params[KEY_HANDLE_ID] == "h-next"
    assert p.reporter.awaited(turn()) == ("h-next", 42), "the next turn awaits D's handle"
    assert progress.ttft_s is not None and p.leg_count("decode", "ok") == 1
    [report] = await reported(p, 1)
    assert report["success"] is True and report["decode_kv_transfer_params"][KEY_HANDLE_ID] == "h-next"


async def test_without_ps_params_d_computes_the_prompt_itself(
    decode: ScriptedEngine, session: aiohttp.ClientSession
) -> None:
    p = parts()
    response = await leg(p, session).whole(
        turn(), route(P_URL, decode.url), {"choices": []}, TurnProgress("pull"), 1
    )
    assert response.status == 200
    [body] = _posts(decode)
    assert "kv_transfer_params" not in body and body["messages"] == turn().body["messages"]


async def test_a_d_that_cannot_be_reached_on_the_first_attempt_is_routed_around(
    session: aiohttp.ClientSession,
) -> None:
    p = parts()
    progress = TurnProgress("pull", prefill_params=dict(P_PARAMS))
    dead = route(P_URL, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(DecodeUnreachable) as unreachable:
        await leg(p, session).whole(turn(), dead, P_ANSWER, progress, attempt=1)
    assert unreachable.value.route is dead and unreachable.value.prefill_params == P_PARAMS
    assert p.routing.reports == [] and p.leg_count("decode", "unreachable") == 1, "the turn is not over yet"


async def test_a_d_that_cannot_be_reached_on_the_last_attempt_fails_the_turn(
    session: aiohttp.ClientSession,
) -> None:
    p = parts()
    dead = route(P_URL, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TurnFailed) as failed:
        await leg(p, session).whole(turn(), dead, P_ANSWER, TurnProgress("pull"), attempt=2)
    assert failed.value.status == 502
    [report] = await reported(p, 1)
    assert report["success"] is False and "unreachable" in report["error"]


async def test_a_request_d_rejects_fails_the_turn_with_ds_answer_and_no_reroute(
    decode: ScriptedEngine, session: aiohttp.ClientSession
) -> None:
    decode.failures = [400]
    p = parts()
    with pytest.raises(TurnFailed) as failed:
        await leg(p, session).whole(
            turn(), route(P_URL, decode.url), P_ANSWER, TurnProgress("pull"), attempt=1
        )
    assert failed.value.status == 400 and b"scripted 400" in failed.value.body


# --- streamed answers ------------------------------------------------------------------------------


@pytest.fixture
async def front(decode: ScriptedEngine) -> AsyncIterator[tuple[str, Parts]]:
    """A front whose one route streams a D leg to its client, as the gateway's completions route does."""
    p = parts()
    async with aiohttp.ClientSession() as upstream:
        part = leg(p, upstream)

        async def handler(request: web.Request) -> web.StreamResponse:
            progress = TurnProgress("pull")
            return await part.streaming(
                request, turn(stream=True), route(P_URL, decode.url), P_ANSWER, progress, 1
            )

        app = web.Application()
        app.router.add_post("/turn", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}/turn", p
        finally:
            await runner.cleanup()


async def _client_events(url: str) -> tuple[aiohttp.ClientResponse, list[Any]]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json={}) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return resp, events


async def test_ds_events_are_forwarded_one_by_one_and_the_turn_is_reported_after(
    front: tuple[str, Parts], decode: ScriptedEngine
) -> None:
    url, p = front
    resp, events = await _client_events(url)
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    assert resp.headers[ROUTE_HEADER] == "r1" and resp.headers[DECISION_HEADER] == "pull"
    assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == [f"t{i}" for i in range(5)]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert not any("kv_transfer_params" in e for e in events[:-1]), (
        "D's handle is the gateway's, not the client's"
    )
    assert _posts(decode)[0]["stream"] is True
    assert p.reporter.awaited(turn()) == ("h-next", 42)
    [report] = await reported(p, 1)
    assert report["success"] is True and report["error"] == ""


async def test_ds_connection_is_kept_for_the_next_leg_when_its_body_ends_after_its_last_event(
    front: tuple[str, Parts], decode: ScriptedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's `data: [DONE]` and the end of its chunked body may come in two reads: the gateway reads
    to the end before it hands the connection back, so the next leg to D reuses it instead of
    opening another (and D never sees it closed under a response it is still ending)."""
    url, p = front
    # D ends each body only after the client has its whole answer; the gateway waits as long as
    # this test may take to let it (a loaded machine included).
    monkeypatch.setattr(legs, "BODY_END_WAIT_S", 60.0)
    decode.end_gate = asyncio.Event()
    for i in range(1, 4):
        resp, events = await _client_events(url)
        assert resp.status == 200 and events[-1] == "[DONE]"
        decode.end_gate.set()
        # The next turn starts once this leg has ended (a turn's next D leg comes after its P leg,
        # never with the last one's end still unread).
        await until(lambda i=i: p.leg_count("decode", "ok") == i, f"D leg {i} to end")
    assert len(decode.client_ports) == 3 and len(set(decode.client_ports)) == 1, decode.client_ports
    assert not decode.aborted
    assert p.leg_count("decode", "ok") == 3


async def test_a_stream_that_breaks_midway_ends_with_an_error_event_and_a_failed_report(
    front: tuple[str, Parts], decode: ScriptedEngine
) -> None:
    url, p = front
    decode.cut_after = 2
    resp, events = await _client_events(url)
    assert resp.status == 200, "the status went out with the first event"
    assert [e["choices"][0]["delta"]["content"] for e in events[:2]] == ["t0", "t1"]
    assert events[2]["error"]["code"] == 502 and events[3] == "[DONE]" and len(events) == 4
    [report] = await reported(p, 1)
    assert report["success"] is False and "decode stream failed" in report["error"]
    assert p.leg_count("decode", "stream_failed") == 1
