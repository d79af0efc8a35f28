"""The sim-engine's OpenAI API over loopback HTTP, in process: where `kv_transfer_params` comes back
(the whole answer's top level, or only the streamed chunk with `finish_reason`), vLLM's tokenizer
routes, errors in vLLM's JSON shape, and the `/sim/*` routes tools and tests use."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvplane.connector.simengine.app import SimEngineServer
from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.openai_api import ENGINE_KEY, build_app
from kvplane.connector.simengine.timeline import prompt_digest
from kvplane.services.common.model.handles import fresh_prefill_params
from kvplane.services.common.runtime.ports import free_port
from tests.support.simengine import MODEL, sim


@pytest.fixture
async def prefill() -> AsyncIterator[tuple[str, SimEngineServer]]:
    server = SimEngineServer(sim(role="prefill", http_port=free_port(), side_channel_port=free_port()))
    await server.start()
    try:
        yield server.http_url, server
    finally:
        await server.stop()


async def _post(url: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, data=json.dumps(body)) as resp:
        return resp.status, await resp.json(content_type=None)


async def _events(url: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=dict(body, stream=True)) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_the_app_serves_vllms_routes_and_the_sims_own() -> None:
    engine = SimEngine(sim())
    app = build_app(engine)
    assert app[ENGINE_KEY] is engine
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    assert {
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/sim/state"),
        ("GET", "/sim/timeline"),
        ("POST", "/sim/release_early"),
        ("POST", "/sim/bidirectional"),
    } <= routes


async def test_a_prefill_answer_carries_ds_params_at_its_top_level(
    prefill: tuple[str, SimEngineServer],
) -> None:
    url, server = prefill
    body = {
        "model": MODEL,
        "prompt": list(range(100, 140)),
        "max_tokens": 1,
        "return_token_ids": True,
        "kv_transfer_params": fresh_prefill_params(),
    }
    status, answer = await _post(url + "/v1/completions", body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == server.engine.engine_id
    assert answer["choices"][0]["prompt_token_ids"] == list(range(100, 140))
    assert answer["usage"]["prompt_tokens"] == 40 and answer["usage"]["completion_tokens"] == 1
    # Held for D's read, and releasable by its request id.
    [held] = (await _get_json(url + "/sim/state"))["retained"]
    assert held["kind"] == "prefill_lease" and held["request_id"] == params["remote_request_id"]
    assert await _post(url + "/sim/release_early", {"request_id": held["request_id"]}) == (
        200,
        {"released": True},
    )
    assert await _post(url + "/sim/release_early", {"request_id": held["request_id"]}) == (
        200,
        {"released": False},
    )


async def test_a_stream_carries_the_params_only_on_the_finishing_chunk_then_usage_then_done(
    prefill: tuple[str, SimEngineServer],
) -> None:
    url, _ = prefill
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 1,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": fresh_prefill_params(),
    }
    *chunks, usage, done = await _events(url + "/v1/chat/completions", body)
    assert done == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0] is chunks[-1] and "kv_transfer_params" in finishing[0]
    assert all("kv_transfer_params" not in c for c in chunks[:-1])
    assert (
        usage["choices"] == []
        and "kv_transfer_params" not in usage
        and usage["usage"]["completion_tokens"] == 1
    )


async def test_tokenize_and_detokenize_round_trip_a_prompt(prefill: tuple[str, SimEngineServer]) -> None:
    url, _ = prefill
    status, tokens = await _post(
        url + "/tokenize", {"model": MODEL, "prompt": "hi there", "add_special_tokens": False}
    )
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert await _post(url + "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": "hi there"})
    status, chat = await _post(url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"model": "other", "prompt": [1]}, 404, "model"),
        ("/v1/completions", {"prompt": [1], "max_tokens": -1}, 400, "max_tokens"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": []}, 400, "tokens"),
        ("/sim/release_early", {"request_id": 7}, 400, "request_id"),
        ("/sim/bidirectional", {"enabled": "no"}, 400, "enabled"),
    ],
)
async def test_a_refused_request_is_answered_in_vllms_error_shape(
    prefill: tuple[str, SimEngineServer], path: str, body: Any, status: int, param: str
) -> None:
    url, _ = prefill
    got, answer = await _post(url + path, body)
    assert got == status and answer["error"]["code"] == status and answer["error"]["param"] == param
    assert answer["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


async def test_a_body_that_is_not_json_is_a_400(prefill: tuple[str, SimEngineServer]) -> None:
    url, _ = prefill
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/sim/release_early"):
        async with aiohttp.ClientSession() as s, s.post(url + path, data=b"{") as resp:
            assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"], path


async def test_models_health_and_state_describe_the_engine(prefill: tuple[str, SimEngineServer]) -> None:
    url, server = prefill
    [model] = (await _get_json(url + "/v1/models"))["data"]
    assert model["id"] == MODEL and model["max_model_len"] == server.settings.max_model_len
    state = await _get_json(url + "/sim/state")
    assert state["engine_id"] == server.engine.engine_id and state["role"] == "prefill"
    assert state["load"]["total_kv_blocks"] == server.settings.num_blocks and state["retained"] == []
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as resp:
        assert resp.status == 200
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}' in await resp.text()


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_the_timeline_times_each_finished_request_under_its_prompts_digest(
    prefill: tuple[str, SimEngineServer],
) -> None:
    url, _ = prefill
    prompts = [list(range(100, 140)), list(range(200, 264))]
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/sim/timeline") as resp:
            start = (await resp.json())["last_seq"]
        for prompt in prompts:
            before = time.perf_counter()
            status, answer = await _post(
                url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 3}
            )
            assert status == 200, answer
        after = time.perf_counter()
        async with s.get(url + "/sim/timeline", params={"since": str(start)}) as resp:
            timeline = await resp.json()
        async with s.get(url + "/sim/timeline", params={"since": "x"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "since"
    requests = timeline["requests"]
    assert [r["digest"] for r in requests] == [prompt_digest(p) for p in prompts]
    assert [r["seq"] for r in requests] == [start + 1, start + 2]
    assert timeline["last_seq"] == start + 2
    # One clock with this process: each request's times lie inside the calls that made them.
    assert (
        requests[0]["arrived"]
        <= requests[0]["first_token"]
        <= requests[0]["finished"]
        <= requests[1]["arrived"]
    )
    assert before <= requests[1]["arrived"] <= requests[1]["first_token"] <= requests[1]["finished"] <= after
