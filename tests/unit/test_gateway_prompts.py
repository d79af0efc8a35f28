"""The prompt a gateway routes with: ids when it has them, else a length."""

from __future__ import annotations

import aiohttp

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
