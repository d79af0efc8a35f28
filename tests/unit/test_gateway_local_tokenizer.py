"""The gateway's own tokenizer (`gateway.tokenizers`): the ids vLLM would make, no /tokenize
call for them, and the engine asked for whatever it alone reproduces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvplane.connector.simengine import toy_tokenizer
from kvplane.connector.simengine.hf_tokenizer import write_tokenizer
from kvplane.services.gateway.local_tokenizer import LocalTokenizers, TokenizerUnavailable
from kvplane.services.gateway.prompts import routed_prompt

MODEL = "toy"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo there"}]


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def local(directory: Path) -> LocalTokenizers:
    return LocalTokenizers({MODEL: str(directory)})


def test_a_text_prompt_gets_the_engines_ids_with_its_bos_unless_the_body_declines_it(
    local: LocalTokenizers,
) -> None:
    assert local.token_ids({"model": MODEL, "prompt": "héllo"}, chat=False) == tuple(
        toy_tokenizer.encode("héllo")
    )
    assert local.token_ids({"model": MODEL, "prompt": ["héllo"]}, chat=False) == tuple(
        toy_tokenizer.encode("héllo")
    )
    bare = {"model": MODEL, "prompt": "héllo", "add_special_tokens": False}
    assert local.token_ids(bare, chat=False) == tuple(toy_tokenizer.encode("héllo", add_bos=False))


def test_chat_messages_get_the_ids_of_the_rendered_template(local: LocalTokenizers) -> None:
    expected = toy_tokenizer.encode(toy_tokenizer.render_chat(CHAT))
    assert local.token_ids({"model": MODEL, "messages": CHAT}, chat=True) == tuple(expected)
    continued = {"model": MODEL, "messages": CHAT, "add_generation_prompt": False}
    assert local.token_ids(continued, chat=True) == tuple(
        toy_tokenizer.encode(toy_tokenizer.render_chat(CHAT, add_generation_prompt=False))
    )


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        pytest.param({"model": "other", "prompt": "hi"}, False, id="a model without a tokenizer here"),
        pytest.param({"prompt": "hi"}, False, id="no model"),
        pytest.param({"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 4}, False, id="truncated"),
        pytest.param({"model": MODEL, "prompt": "hi", "add_special_tokens": "yes"}, False, id="odd flag"),
        pytest.param({"model": MODEL, "messages": CHAT, "tools": []}, True, id="tools"),
        pytest.param({"model": MODEL, "messages": CHAT, "chat_template": "{{ 1 }}"}, True, id="own template"),
        pytest.param({"model": MODEL, "messages": CHAT, "documents": []}, True, id="documents"),
        pytest.param(
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
            True,
            id="content parts",
        ),
        pytest.param(
            {"model": MODEL, "messages": [{"role": "assistant", "content": "", "tool_calls": []}]},
            True,
            id="tool calls",
        ),
        pytest.param({"model": MODEL, "messages": []}, True, id="no messages"),
        pytest.param({"model": MODEL, "messages": CHAT, "add_generation_prompt": 1}, True, id="odd option"),
        pytest.param({"model": MODEL, "messages": CHAT, "chat_template_kwargs": []}, True, id="odd kwargs"),
    ],
)
def test_what_only_the_engine_reproduces_is_left_to_it(
    local: LocalTokenizers, body: dict[str, Any], chat: bool
) -> None:
    assert local.token_ids(body, chat) is None


def test_a_template_that_raises_leaves_the_answer_to_the_engine(tmp_path: Path, directory: Path) -> None:
    raising = tmp_path / "raising"
    raising.mkdir()
    for f in directory.iterdir():
        (raising / f.name).write_bytes(f.read_bytes())
    (raising / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages[0]['content'] }}{{ greeting }}"
    )
    local = LocalTokenizers({MODEL: str(raising)})
    assert local.token_ids({"model": MODEL, "messages": CHAT}, chat=True) is None
    # The request's template kwargs reach the template.
    asked = {"model": MODEL, "messages": CHAT[1:], "chat_template_kwargs": {"greeting": "!"}}
    assert local.token_ids(asked, chat=True) == tuple(toy_tokenizer.encode("héllo there!", add_bos=False))


def test_a_tokenizer_that_cannot_be_loaded_is_refused_naming_the_model(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable, match=r"gateway.tokenizers\['m'\].*nowhere"):
        LocalTokenizers({"m": str(tmp_path / "nowhere")})
    assert not LocalTokenizers({})


async def test_routing_gets_local_ids_without_asking_the_engine_and_the_engine_for_the_rest(
    local: LocalTokenizers,
) -> None:
    asked: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({"tokens": [7, 8, 9], "count": 3})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    timed: list[str] = []
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        url = str(server.make_url(""))

        async def routed(body: dict[str, Any], chat: bool) -> tuple[int, ...]:
            prompt = await routed_prompt(
                session, body, chat, url, 5.0, timed=lambda o, _s: timed.append(o), local=local
            )
            return prompt.token_ids

        completion = {"model": MODEL, "prompt": "héllo"}
        assert await routed(completion, False) == tuple(toy_tokenizer.encode("héllo"))
        # The completions body carries the ids on to the engines, as with /tokenize.
        assert completion["prompt"] == toy_tokenizer.encode("héllo")
        chat = {"model": MODEL, "messages": CHAT}
        assert await routed(chat, True) == tuple(toy_tokenizer.encode(toy_tokenizer.render_chat(CHAT)))
        assert chat["messages"] == CHAT
        assert asked == [] and timed == ["local", "local"]
        tools = {"model": MODEL, "messages": CHAT, "tools": []}
        assert await routed(tools, True) == (7, 8, 9)
    # Only the turn with tools asked the engine.
    assert asked == [{"model": MODEL, "messages": CHAT, "add_generation_prompt": True, "tools": []}]
    assert timed == ["local", "local", "ok"]


def test_a_tokenizer_that_fails_on_a_prompt_leaves_it_to_the_engine(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = LocalTokenizers({MODEL: str(directory)})

    def failing(*_args: Any, **_kwargs: Any) -> list[int]:
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(local._by_model[MODEL], "encode", failing)
    assert local.token_ids({"model": MODEL, "prompt": "hi"}, chat=False) is None
    assert local.token_ids({"model": MODEL, "messages": CHAT}, chat=True) is None
