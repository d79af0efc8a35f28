"""One turn through `TurnRunner`, with a scripted routing client and scripted engines over loopback
HTTP: Route, P, D, the report; a D that cannot be reached routed around once and never returned to;
a prompt D would refuse refused before Route checks a handle out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.gateway.decode_leg import DECISION_HEADER, ROUTE_HEADER
from kvplane.services.gateway.progress import TurnRequest
from kvplane.services.gateway.turn import TurnRunner
from kvplane.services.gateway.turn_errors import TurnFailed
from tests.integration.test_gateway_front import P_PARAMS, ScriptedEngine
from tests.support.gateway_parts import Parts, parts, reported, route, turn


@dataclass
class Stack:
    url: str
    parts: Parts
    prefill: ScriptedEngine
    decode: list[ScriptedEngine]
    # The front's turns by id: the test decides the turn, the front only runs it.
    turns: dict[str, TurnRequest] = field(default_factory=dict)

    async def run(self, request: TurnRequest) -> tuple[int, dict[str, str], Any]:
        key = str(len(self.turns))
        self.turns[key] = request
        async with aiohttp.ClientSession() as s, s.post(self.url, json=key) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def _start(app: web.Application) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}/turn", runner


@pytest.fixture
async def engines() -> AsyncIterator[tuple[ScriptedEngine, list[ScriptedEngine]]]:
    prefill, decode = ScriptedEngine("prefill"), [ScriptedEngine("decode"), ScriptedEngine("decode")]
    for engine in (prefill, *decode):
        await engine.start()
    try:
        yield prefill, decode
    finally:
        for engine in (prefill, *decode):
            await engine.stop()


async def _stack(
    engines: tuple[ScriptedEngine, list[ScriptedEngine]], **settings: Any
) -> tuple[Stack, web.AppRunner, aiohttp.ClientSession]:
    p = parts(**settings)
    session = aiohttp.ClientSession()
    runner = TurnRunner(p.settings, p.routing, session, p.metrics, p.tracer)  # type: ignore[arg-type]
    turns: dict[str, TurnRequest] = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await runner.serve(request, turns[await request.json()])
        except TurnFailed as exc:
            return web.json_response({"error": exc.message, "body": exc.body.decode()}, status=exc.status)

    app = web.Application()
    app.router.add_post("/turn", handler)
    url, app_runner = await _start(app)
    return Stack(url, p, *engines, turns=turns), app_runner, session


@pytest.fixture
async def stack(engines: tuple[ScriptedEngine, list[ScriptedEngine]]) -> AsyncIterator[Stack]:
    s, runner, session = await _stack(engines)
    try:
        yield s
    finally:
        await runner.cleanup()
        await session.close()


@pytest.fixture
async def short_context(engines: tuple[ScriptedEngine, list[ScriptedEngine]]) -> AsyncIterator[Stack]:
    s, runner, session = await _stack(engines, max_model_len=8, tokenize_url=engines[0].url)
    try:
        yield s
    finally:
        await runner.cleanup()
        await session.close()


def _posts(engine: ScriptedEngine) -> int:
    return len([path for path, _, _ in engine.seen if path.startswith("/v1/")])


async def test_a_turn_is_routed_then_runs_p_then_d_and_is_reported(stack: Stack) -> None:
    stack.parts.routing.routes.append(route(stack.prefill.url, stack.decode[0].url))
    sent_ms = int(time.time() * 1000)
    status, headers, answer = await stack.run(turn())
    answered_ms = int(time.time() * 1000)
    assert status == 200 and headers[DECISION_HEADER] == "pull" and headers[ROUTE_HEADER] == "r1"
    assert answer["choices"][0]["message"]["reasoning_content"] == "first, think"
    assert (_posts(stack.prefill), _posts(stack.decode[0]), _posts(stack.decode[1])) == (1, 1, 0)
    [report] = await reported(stack.parts, 1)
    assert report["route"].route_id == "r1" and report["success"] is True
    # When the answer ended, for routing to tell which of D's load reports still count it.
    assert sent_ms <= report["ended_unix_ms"] <= answered_ms


async def test_a_turn_prefilled_on_its_holder_skips_p_and_gives_d_the_routes_params(
    engines: tuple[ScriptedEngine, list[ScriptedEngine]],
) -> None:
    s, runner, session = await _stack(engines, prefill_on_decode=True)
    try:
        local = {"do_remote_prefill": False, "do_remote_decode": False, "kvplane_tenant": "acme"}
        on_decode = route(s.decode[0].url, s.decode[0].url, decision="prefill_on_decode", prefill_id="d0")
        s.parts.routing.routes.append(replace(on_decode, prefill_params=dict(local)))
        status, headers, answer = await s.run(turn())
        assert status == 200 and headers[DECISION_HEADER] == "prefill_on_decode"
        assert answer["choices"][0]["message"]["reasoning_content"] == "first, think"
        # No P leg: D alone got the client's request, carrying the route's params as they are.
        assert (_posts(s.prefill), _posts(s.decode[0])) == (0, 1)
        [(_, body, _)] = [seen for seen in s.decode[0].seen if seen[0].startswith("/v1/")]
        assert body["kv_transfer_params"] == local and body["messages"] == turn().body["messages"]
        assert s.parts.routing.asked[0]["prefill_on_decode_ok"] is True
        [report] = await reported(s.parts, 1)
        assert report["success"] is True and report["route"].decision == "prefill_on_decode"
    finally:
        await runner.cleanup()
        await session.close()


async def test_a_gateway_asks_for_turns_on_d_alone_unless_set_not_to(
    engines: tuple[ScriptedEngine, list[ScriptedEngine]],
) -> None:
    # By default routing may send a turn to its D alone (its policy weighs when); set off, never.
    for setting, asked in ((None, True), (False, False)):
        settings = {} if setting is None else {"prefill_on_decode": setting}
        s, runner, session = await _stack(engines, **settings)
        try:
            s.parts.routing.routes.append(route(s.prefill.url, s.decode[0].url))
            assert (await s.run(turn()))[0] == 200
            assert s.parts.routing.asked[0]["prefill_on_decode_ok"] is asked
        finally:
            await runner.cleanup()
            await session.close()


async def test_a_d_that_cannot_be_reached_is_routed_around_once_and_never_returned_to(stack: Stack) -> None:
    dead, alive = stack.decode
    dead.drop_next = 1
    stack.parts.routing.routes += [
        route(stack.prefill.url, dead.url),
        route(stack.prefill.url, alive.url, route_id="r2", decode_id="d1"),
    ]
    status, headers, _ = await stack.run(turn())
    assert status == 200 and headers[ROUTE_HEADER] == "r2"
    first, second = stack.parts.routing.asked
    assert first["failed_node_ids"] == () and second["failed_node_ids"] == ("d0",)
    assert _posts(stack.prefill) == 2, "P runs again for the new D"
    assert stack.parts.metric("kvplane_gateway_retries_total", reason="decode_unreachable") == 1
    reports = {r["route"].route_id: r for r in await reported(stack.parts, 2)}
    assert reports["r1"]["success"] is False and reports["r1"]["prefill_kv_transfer_params"] == P_PARAMS
    assert reports["r2"]["success"] is True
    # The unreachable D never ran the request: its report says no end for routing to take out.
    assert reports["r1"]["ended_unix_ms"] is None and reports["r2"]["ended_unix_ms"] is not None


async def test_a_turn_whose_second_d_cannot_be_reached_either_fails_with_a_bad_gateway(stack: Stack) -> None:
    for engine in stack.decode:
        engine.drop_next = 1
    stack.parts.routing.routes += [
        route(stack.prefill.url, stack.decode[0].url),
        route(stack.prefill.url, stack.decode[1].url, route_id="r2", decode_id="d1"),
    ]
    status, _, answer = await stack.run(turn())
    assert status == 502 and "unreachable" in answer["error"]
    assert len(stack.parts.routing.asked) == 2, "a turn runs at most twice"


async def test_a_prompt_longer_than_d_accepts_is_refused_before_routing_is_asked(
    short_context: Stack,
) -> None:
    body = {"model": "m", "prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 5}
    status, _, answer = await short_context.run(turn(body=body, chat=False))
    assert status == 400 and "8" in answer["error"]
    assert short_context.parts.routing.asked == [] and _posts(short_context.prefill) == 0


async def test_a_model_no_engine_serves_is_a_404_before_routing_is_asked(short_context: Stack) -> None:
    body = {"model": "other", "prompt": "hello", "max_tokens": 1}
    status, _, answer = await short_context.run(turn(body=body, chat=False))
    assert status == 404 and "does not exist" in answer["body"], "the engine's own error body"
    assert short_context.parts.routing.asked == []
