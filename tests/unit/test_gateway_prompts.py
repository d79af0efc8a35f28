"""The prompt a gateway routes with: ids when it has them, else a length; the engine's /tokenize
timed."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvplane.services.gateway.prompts import estimate_tokens, routed_prompt


async def test_token_id_prompts_route_with_their_ids() -> None:
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [5, 6, 7]}
        assert (await routed_prompt(session, body, False, "", 1.0)).token_ids == (5, 6, 7)
        batch_of_one = {"prompt": [[5, 6]]}
        assert (await routed_prompt(session, batch_of_one, False, "", 1.0)).tokens == 2


async def test_without_a_tokenizer_text_routes_with_an_upper_estimate() -> None:
    async with aiohttp.ClientSession() as session:
        prompt = await routed_prompt(session, {"prompt": "héllo"}, False, "", 1.0)
        assert prompt.token_ids == () and prompt.tokens == 6
        chat = {"messages": [{"role": "user", "content": "hello there"}]}
        assert (await routed_prompt(session, chat, True, "", 1.0)).tokens >= len("hello there")


def test_estimate_is_never_zero() -> None:
    assert estimate_tokens({"prompt": ""}, False) == 1


async def test_each_tokenize_call_is_timed_with_its_outcome() -> None:
    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") == "broken":
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"tokens": [1, 2, 3], "count": 3})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    timed: list[tuple[str, float]] = []
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = str(server.make_url(""))
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        prompt = await routed_prompt(session, chat, True, url, 5.0, timed=lambda o, s: timed.append((o, s)))
        assert prompt.token_ids == (1, 2, 3)
        broken = await routed_prompt(
            session, {**chat, "model": "broken"}, True, url, 5.0, timed=lambda o, s: timed.append((o, s))
        )
        assert broken.token_ids == ()  # routed with an estimate, the call counted as an error
        # Prompts already in token ids ask no engine: nothing to time.
        await routed_prompt(
            session, {"prompt": [4, 5]}, False, url, 5.0, timed=lambda o, s: timed.append((o, s))
        )
    assert [outcome for outcome, _ in timed] == ["ok", "error"]
    assert all(seconds >= 0 for _, seconds in timed)
