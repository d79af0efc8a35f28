"""The gateway's HTTP contract against scripted engines: what passes through, what is stripped, which
headers reach each leg, how failures surface, and the `kvplane gateway` command.

Routing points at a closed port here, so every turn takes the configured fallback pair.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from kvplane.services.common.model.handles import KEY_DIGESTS
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from tests.support.gateway_stack import metric_sum
from tests.support.polling import eventually

KEY = "key-front-0123456789"
P_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p-engine", "remote_block_ids": [[1, 2]]}
D_HANDLE = {"do_remote_decode": True, "remote_engine_id": "d-engine", "remote_num_tokens": 42}
CHAT_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "system_fingerprint": "fp-1",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "first, think",
                "reasoning": "first, think",
                "tool_calls": [
                    {
                        "id": "call-1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"q": "kv"}'},
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 11,
        "completion_tokens": 7,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 3},
    },
}


@dataclass
class ScriptedEngine:
    """Answers as a P or D engine would; `failures` makes the next POSTs fail with that status."""

    role: str
    seen: list[tuple[str, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    # Streaming: break the connection after this many events.
    cut_after: int | None = None
    # When set, the answer is still being generated until the test opens this gate: a streamed
    # answer waits after its first event, a whole answer before it is sent. `aborted` says the
    # client went away meanwhile.
    generating: asyncio.Event | None = None
    aborted: bool = False
    # Close the connection of the next this-many POSTs without answering, as a dying engine does.
    drop_next: int = 0
    # Whether it offers vLLM's /tokenize (the sim-engine does not).
    tokenizes: bool = True
    # Streaming: when set, the body ends (after `data: [DONE]`) only once the test opens this gate,
    # in a write of its own, as uvicorn under vLLM ends a response; each end closes it again.
    end_gate: asyncio.Event | None = None
    # The client port of every POST, in order: how many connections the posts came on.
    client_ports: list[int] = field(default_factory=list)
    # What a decode engine's last event (or answer) returns as its handle.
    handle: dict[str, Any] = field(default_factory=lambda: dict(D_HANDLE))
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/{kind}", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append((request.path, body, dict(request.headers)))
        if not self.tokenizes:
            return web.json_response({"detail": "Not Found"}, status=404)
        if body.get("model") not in (None, "m"):
            # vLLM's answer for a model it does not serve.
            error = {
                "message": f"The model `{body['model']}` does not exist.",
                "type": "NotFoundError",
                "code": 404,
            }
            return web.json_response({"error": error}, status=404)
        return web.json_response({"tokens": [ord(c) for c in body["prompt"]], "count": len(body["prompt"])})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, dict(request.headers)))
        assert request.transport is not None
        self.client_ports.append(request.transport.get_extra_info("peername")[1])
        if self.drop_next:
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.failures:
            status = self.failures.pop(0)
            return web.json_response(
                {"error": {"message": f"scripted {status}", "code": status}}, status=status
            )
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": P_PARAMS})
        if not body.get("stream"):
            try:
                if self.generating is not None:
                    await self.generating.wait()
            except asyncio.CancelledError:
                self.aborted = True
                raise
            return web.json_response({**CHAT_ANSWER, "kv_transfer_params": self.handle})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            if self.cut_after is not None and i >= self.cut_after:
                assert request.transport is not None
                request.transport.close()
                return resp
            chunk: dict[str, Any] = {
                "id": "c",
                "choices": [
                    {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": "stop" if i == 4 else None}
                ],
            }
            if body.get("return_token_ids"):
                chunk["choices"][0]["token_ids"] = [100 + i]
            if i == 4:
                chunk["kv_transfer_params"] = self.handle
            try:
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if self.generating is not None:
                    await self.generating.wait()
            except ConnectionResetError:
                self.aborted = True
                return resp
            except asyncio.CancelledError:
                self.aborted = True
                raise
        await resp.write(b"data: [DONE]\n\n")
        if self.end_gate is not None:
            await self.end_gate.wait()
            self.end_gate.clear()
        await resp.write_eof()
        return resp


@dataclass
class Front:
    gateway: Gateway
    prefill: ScriptedEngine
    decode: ScriptedEngine
    session: aiohttp.ClientSession

    async def post(self, path: str, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
        headers.setdefault("Authorization", f"Bearer {KEY}")
        resp = await self.session.post(self.gateway.url + path, json=body, headers=headers)
        await resp.read()
        return resp

    async def metric(self, name: str, **labels: str) -> float:
        async with self.session.get(self.gateway.url + "/metrics") as resp:
            return metric_sum(await resp.text(), name, **labels)


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    prefill, decode = ScriptedEngine("prefill"), ScriptedEngine("decode")
    await prefill.start()
    await decode.start()
    gateway = Gateway(
        GatewaySection(
            listen=f"127.0.0.1:{free_port()}",
            routing=[f"127.0.0.1:{free_port()}"],  # nothing listens there
            routing_timeout_s=0.2,
            api_keys=[GatewayKey(token=SecretStr(KEY), tenant="acme")],
            fallback_prefill_url=prefill.url,
            fallback_decode_url=decode.url,
            prefill_timeout_s=2.0,
        ),
        Telemetry.disabled("kvplane-gateway"),
    )
    await gateway.start()
    session = aiohttp.ClientSession()
    try:
        yield Front(gateway, prefill, decode, session)
    finally:
        await session.close()
        await gateway.stop()
        await prefill.stop()
        await decode.stop()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


async def test_non_streaming_answer_keeps_usage_tool_calls_and_reasoning(front: Front) -> None:
    resp = await front.post("/v1/chat/completions", dict(CHAT), **{"X-Conversation-Id": "c1"})
    assert resp.status == 200
    answer = await resp.json()
    assert answer == CHAT_ANSWER  # everything but D's handle, untouched
    assert resp.headers["x-kvplane-decision"] == "fallback"
    # The legs: P with one token and turn-1 params, D with P's params plus the tenant keys.
    (_, p_body, _), (_, d_body, _) = front.prefill.seen[-1], front.decode.seen[-1]
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["remote_engine_id"] is None
    assert d_body["kv_transfer_params"] == {
        **P_PARAMS,
        "kvplane_tenant": "acme",
        "kvplane_conversation": "c1",
    }
    assert d_body["max_tokens"] == 5 and d_body["messages"] == CHAT["messages"]


async def test_both_legs_carry_the_callers_trace(front: Front) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = f"00-{trace_id}-00f067aa0ba902b7-01"
    # Header names are case-insensitive: the gateway must find this one however it is spelled.
    resp = await front.post("/v1/chat/completions", dict(CHAT), Traceparent=parent)
    assert resp.status == 200
    legs = [front.prefill.seen[-1][2], front.decode.seen[-1][2]]
    parents = [h.get("traceparent", "") for h in legs]
    assert all(p.startswith(f"00-{trace_id}-") for p in parents), parents
    # Each leg is its own span of the turn.
    assert parents[0] != parents[1] and parent not in parents


async def test_streaming_strips_the_handle_and_passes_every_event(front: Front) -> None:
    async with front.session.post(
        front.gateway.url + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [f"t{i}" for i in range(5)]
    assert "kv_transfer_params" not in raw
    assert front.decode.seen[-1][1]["stream"] is True


@pytest.mark.parametrize(
    ("path", "body", "foreign"),
    [
        ("/v1/chat/completions", CHAT, {"prompt": "not a chat field", "suffix": "nor this"}),
        ("/v1/completions", {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}, {"tools": []}),
    ],
    ids=["chat", "completions"],
)
async def test_fields_the_engines_do_not_accept_reach_neither_leg(
    front: Front, path: str, body: dict[str, Any], foreign: dict[str, Any]
) -> None:
    # vLLM ignores a field it does not know, but would be sent it on both legs of every turn.
    front.gateway.settings.pass_through_fields = ["engine_extension"]
    dropped = await front.metric("kvplane_gateway_dropped_fields_total")
    sent = {**body, "x": [[]] * 1000, **foreign, "top_k": 5, "seed": 7, "engine_extension": {"a": 1}}
    resp = await front.post(path, sent)
    assert resp.status == 200
    for engine in (front.prefill, front.decode):
        (_, leg, _) = engine.seen[-1]
        assert "x" not in leg and not set(foreign) & set(leg), engine.role
        # vLLM's own fields, and the one the operator lets through, reach both.
        assert (leg["top_k"], leg["seed"], leg["engine_extension"]) == (5, 7, {"a": 1}), engine.role
    assert await front.metric("kvplane_gateway_dropped_fields_total") == dropped + 1 + len(foreign)


async def test_decode_engine_is_asked_for_token_ids_only_while_a_turn_needs_them(front: Front) -> None:
    # The prompt's ids are known (a token-id prompt); the output's are needed only while D's handle
    # may come without digests of what it retains, and the client's own wish always counts.
    async def turn(**extra: Any) -> tuple[bool, list[list[int] | None]]:
        """Whether D was asked for token ids, and the ids each token's event brought the client."""
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 5, "stream": True, **extra}
        async with front.session.post(
            front.gateway.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            assert resp.status == 200
            raw = (await resp.read()).decode()
        assert "kv_transfer_params" not in raw
        data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        choices = [json.loads(d)["choices"][0] for d in data[:-1]]
        assert [c["delta"]["content"] for c in choices] == [f"t{i}" for i in range(5)]
        return bool(front.decode.seen[-1][1].get("return_token_ids")), [c.get("token_ids") for c in choices]

    front.decode.handle = {**D_HANDLE, KEY_DIGESTS: "c29tZS1kaWdlc3Rz"}
    # An engine not seen yet is asked; the ids are taken out of what the client gets.
    assert await turn() == (True, [None] * 5)
    # Its handles bring digests: nothing to ask.
    assert await turn() == (False, [None] * 5)
    # The client asks: so is D, and the ids reach the client.
    assert await turn(return_token_ids=True) == (True, [[100 + i] for i in range(5)])
    # A handle without digests: learned from this turn ...
    front.decode.handle = dict(D_HANDLE)
    assert await turn() == (False, [None] * 5)
    # ... so the next one asks for the output's ids, for the report.
    assert await turn() == (True, [None] * 5)


async def test_decode_stream_cut_midway_ends_with_an_error_event(front: Front) -> None:
    front.decode.cut_after = 2
    async with front.session.post(
        front.gateway.url + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as resp:
        raw = (await resp.read()).decode()
    assert '"t0"' in raw and '"t1"' in raw and '"t2"' not in raw
    assert "BadGatewayError" in raw and raw.rstrip().endswith("data: [DONE]")
    assert await front.metric("kvplane_gateway_turns_total", decision="fallback", outcome="failed") == 1


async def test_prefill_failing_twice_is_a_bad_gateway(front: Front) -> None:
    front.prefill.failures = [503, 503]
    resp = await front.post("/v1/chat/completions", dict(CHAT))
    assert resp.status == 502
    assert len(front.prefill.seen) == 2 and not front.decode.seen
    assert await front.metric("kvplane_gateway_retries_total", reason="prefill_http_503") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_unreachable_decode_engine_gets_the_turn_routed_again(front: Front, stream: bool) -> None:
    front.decode.drop_next = 1
    resp = await front.post("/v1/chat/completions", {**CHAT, "stream": stream})
    assert resp.status == 200
    assert (len(front.prefill.seen), len(front.decode.seen)) == (2, 2)
    assert await front.metric("kvplane_gateway_retries_total", reason="decode_unreachable") == 1


async def test_prefill_dropping_the_connection_is_retried_without_the_handle(front: Front) -> None:
    front.prefill.drop_next = 1
    resp = await front.post("/v1/chat/completions", dict(CHAT))
    assert resp.status == 200 and resp.headers["x-kvplane-decision"] == "retry_no_handle"
    assert len(front.prefill.seen) == 2 and len(front.decode.seen) == 1
    assert await front.metric("kvplane_gateway_retries_total", reason="prefill_unreachable") == 1


async def test_prefill_rejecting_the_request_is_not_retried(front: Front) -> None:
    front.prefill.failures = [400]
    resp = await front.post("/v1/chat/completions", dict(CHAT))
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "scripted 400"
    assert len(front.prefill.seen) == 1


async def test_client_leaving_midway_aborts_the_decode_leg(front: Front) -> None:
    front.decode.generating = asyncio.Event()  # never set: the answer is still coming when the client leaves
    async with front.session.post(
        front.gateway.url + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as resp:
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()

    async def aborted() -> bool:
        return front.decode.aborted

    await eventually(aborted, timeout_s=5, what="D's request to be aborted")
    await eventually(
        lambda: front.metric("kvplane_gateway_leg_seconds_count", leg="decode", outcome="client_gone"),
        timeout_s=5,
        what="the decode leg to be counted as abandoned",
    )


async def test_client_leaving_a_non_streaming_request_aborts_the_decode_leg(front: Front) -> None:
    front.decode.generating = asyncio.Event()  # never set: the answer never comes
    with pytest.raises(TimeoutError):
        await front.session.post(
            front.gateway.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=aiohttp.ClientTimeout(total=0.5),
        )

    async def aborted() -> bool:
        return front.decode.aborted

    await eventually(aborted, timeout_s=5, what="D's request to be aborted")
    await eventually(
        lambda: front.metric("kvplane_gateway_turns_total", decision="fallback", outcome="failed"),
        timeout_s=5,
        what="the abandoned turn to be counted",
    )


async def test_text_prompts_are_sent_as_token_ids_when_a_tokenizer_is_configured(front: Front) -> None:
    front.gateway.settings.tokenize_url = front.prefill.url
    body = {"model": "m", "prompt": "abc", "max_tokens": 2}
    resp = await front.post("/v1/completions", body)
    assert resp.status == 200
    assert front.prefill.seen[0][0] == "/tokenize"
    assert front.prefill.seen[-1][1]["prompt"] == [97, 98, 99]
    assert front.decode.seen[-1][1]["prompt"] == [97, 98, 99]
    # The call is a timed leg of the turn.
    assert await front.metric("kvplane_gateway_leg_seconds_count", leg="tokenize", outcome="ok") == 1


async def test_an_engine_without_tokenize_is_not_asked_on_every_turn(front: Front) -> None:
    front.prefill.tokenizes = False
    front.gateway.settings.tokenize_url = front.prefill.url
    for _ in range(3):
        resp = await front.post("/v1/completions", {"model": "m", "prompt": "abc", "max_tokens": 2})
        assert resp.status == 200
    assert [path for path, _, _ in front.prefill.seen].count("/tokenize") == 1
    assert front.prefill.seen[-1][1]["prompt"] == "abc"
    assert await front.metric("kvplane_gateway_leg_seconds_count", leg="tokenize", outcome="error") == 1


async def test_an_unknown_model_is_404_for_that_request_alone_and_tokenizing_goes_on(front: Front) -> None:
    front.gateway.settings.tokenize_url = front.prefill.url
    bad = await front.post("/v1/completions", {"model": "nope", "prompt": "abc", "max_tokens": 2})
    assert bad.status == 404
    assert "nope" in (await bad.json())["error"]["message"]
    good = await front.post("/v1/completions", {"model": "m", "prompt": "abc", "max_tokens": 2})
    assert good.status == 200
    assert [path for path, _, _ in front.prefill.seen].count("/tokenize") == 2
    assert front.prefill.seen[-1][1]["prompt"] == [97, 98, 99], "the next request is still sent as token ids"


async def test_models_and_health(front: Front) -> None:
    async with front.session.get(
        front.gateway.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}
    ) as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
    async with front.session.get(front.gateway.url + "/health") as resp:
        assert resp.status == 200


def _spawn_gateway(log: Path, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvplane.services.cli", "gateway", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, KVPLANE_TELEMETRY__METRICS_PORT="0"),
            start_new_session=True,
        )


@pytest.mark.parametrize("loop", [None, "asyncio"])
async def test_gateway_command_serves_until_sigterm(tmp_path: Path, loop: str | None) -> None:
    prefill, decode = ScriptedEngine("prefill"), ScriptedEngine("decode")
    await prefill.start()
    await decode.start()
    port = free_port()
    log = tmp_path / "gateway.log"
    proc = _spawn_gateway(
        log,
        *("--listen", f"127.0.0.1:{port}", "--default-tenant", "dev", "--model", "m"),
        *("--routing", f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"),
        *("--fallback-prefill", prefill.url, "--fallback-decode", decode.url),
        *(("--event-loop", loop) if loop else ()),
    )
    try:
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    return r.status == 200

            await eventually(healthy, timeout_s=60, what="the gateway command to serve")
            # No key at all: the development default tenant.
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200, await r.text()
            assert decode.seen[-1][1]["kv_transfer_params"]["kvplane_tenant"] == "dev"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
        # uvloop unless told otherwise; either loop serves the turn and stops cleanly.
        assert f"(event loop: {loop or 'uvloop'})" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await prefill.stop()
        await decode.stop()


async def test_a_body_of_more_json_values_than_any_prompt_is_refused_before_parsing(front: Front) -> None:
    # 2.2 million token ids (4.4 MB, under the 16 MiB body limit): more than twice the most prompt
    # tokens the gateway accepts without a known context length, plus room. Refused unparsed.
    raw = b'{"model": "m", "prompt": [' + b"0," * 2_200_000 + b'0], "max_tokens": 1}'
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with front.session.post(front.gateway.url + "/v1/completions", data=raw, headers=headers) as resp:
        assert resp.status == 413
        answer = await resp.json()
    assert "JSON values" in answer["error"]["message"] and "context length" in answer["error"]["message"]
    assert not front.prefill.seen and not front.decode.seen
    ok = await front.post("/v1/chat/completions", dict(CHAT))
    assert ok.status == 200, "the gateway serves the next request as before"
