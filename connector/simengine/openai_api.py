"""The part of vLLM's OpenAI HTTP API that P/D serving uses.

``kv_transfer_params`` comes back at the top level of a non-streaming
response, and at the top level of the streaming chunk that carries
``finish_reason`` (a later usage-only chunk carries none). Every SSE event
is written as soon as its token exists.

Besides the OpenAI routes, ``GET /sim/state`` and ``POST /sim/release_early``
expose the engine's load and retained handles for tests and tooling, and
``POST /sim/bidirectional`` ``{"enabled": bool}`` turns D's retention of finished
turns on or off for the turns that start after it (as restarting vLLM with or
without ``bidirectional_kv_xfer`` would; handles already retained stay);
``POST /sim/host_tier`` ``{"enabled": bool}`` turns moving handles to the host tier on or off
(handles already there stay; off, a short engine waits for the control plane's releases);
``kv_cache_routes.py`` adds vLLM's ``POST /reset_prefix_cache`` and the KV event
fault hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvplane.connector.simengine import toy_tokenizer
from kvplane.connector.simengine.block_pool import KvCacheFullError
from kvplane.connector.simengine.engine import FinishInfo, GenerationRequest, SimEngine, TokenEvent
from kvplane.connector.simengine.kv_cache_routes import kv_cache_routes
from kvplane.connector.simengine.toy_tokenizer import PromptError

ENGINE_KEY: web.AppKey[SimEngine] = web.AppKey("engine", SimEngine)
# vLLM's header naming the session a request belongs to (its KV events carry it).
SESSION_ID_HEADER = "X-Session-ID"


class RequestError(Exception):
    """A request the API rejects, with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "Error")
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


@dataclass(frozen=True)
class ParsedRequest:
    """What both endpoints share once the body is understood."""

    chat: bool
    request: GenerationRequest
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be a boolean", param=key)
    return v


def _prompt_ids(engine: SimEngine, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return toy_tokenizer.encode(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = engine.settings.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"token ids must be within [0, {vocab})", param="prompt")
        return list(prompt)
    raise RequestError(
        "prompt must be a string or a non-empty list of token ids (batches are not supported)", param="prompt"
    )


def _chat_ids(body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages must be a list", param="messages")
    try:
        return toy_tokenizer.encode(
            toy_tokenizer.render_chat(
                messages, add_generation_prompt=_bool(body, "add_generation_prompt", True)
            )
        )
    except PromptError as e:
        raise RequestError(str(e), param="messages") from e


def _session_id(body: Mapping[str, Any], header: str | None) -> str | None:
    """vLLM's order: the body's `session_id`, then the X-Session-ID header."""
    value = body.get("session_id")
    if value is not None and not isinstance(value, str):
        raise RequestError("session_id must be a string", param="session_id")
    return value or header or None


def parse_request(
    engine: SimEngine,
    body: Any,
    chat: bool,
    request_id_header: str | None = None,
    session_id_header: str | None = None,
) -> ParsedRequest:
    s = engine.settings
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != s.model:
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", param="n")
    reasoning = 0
    if chat:
        ids = _chat_ids(body)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        kwargs = body.get("chat_template_kwargs") or {}
        if isinstance(kwargs, dict) and kwargs.get("enable_thinking", True) is not False:
            reasoning = s.reasoning_tokens
    else:
        ids = _prompt_ids(engine, body.get("prompt"))
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = s.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise RequestError("max_tokens must be a positive integer", param="max_tokens")
    if len(ids) + max_tokens > s.max_model_len:
        raise RequestError(
            f"This model's maximum context length is {s.max_model_len} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion).",
            param="max_tokens",
        )
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, dict):
        raise RequestError("kv_transfer_params must be an object", param="kv_transfer_params")
    stream = _bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        # vLLM's rule for the field.
        raise RequestError("Parameter cache_salt must be a non-empty string if provided.", param="cache_salt")
    prefix = "chatcmpl" if chat else "cmpl"
    # Like vLLM, take the caller's X-Request-Id into the internal id; a suffix keeps a retried
    # id from colliding with a handle the engine still holds.
    base = f"{request_id_header[:128]}-{uuid.uuid4().hex[:8]}" if request_id_header else uuid.uuid4().hex
    return ParsedRequest(
        chat=chat,
        request=GenerationRequest(
            request_id=f"{prefix}-{base}",
            prompt_token_ids=tuple(ids),
            max_tokens=max_tokens,
            ignore_eos=_bool(body, "ignore_eos"),
            kv_transfer_params=kvp,
            reasoning_tokens=reasoning,
            cache_salt=salt,
            session_id=_session_id(body, session_id_header),
        ),
        stream=stream,
        include_usage=stream and _bool(opts, "include_usage"),
        return_token_ids=_bool(body, "return_token_ids"),
    )


def _usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


class _Responder:
    """Builds response bodies and chunks for one request."""

    def __init__(self, engine: SimEngine, p: ParsedRequest) -> None:
        self.p = p
        self.model = engine.settings.model
        self.created = int(time.time())
        self.id = p.request.request_id
        self._emitted = 0
        # Output positions of the reasoning text and of the answer, when the chat reasons.
        r = p.request.reasoning_tokens if p.chat else 0
        opening, closing = len(toy_tokenizer.think_open()), len(toy_tokenizer.think_close())
        self._reasoning = range(opening, opening + r) if r else range(0)
        self._answer_from = opening + r + closing if r else 0

    def _delta(self, index: int, text: str) -> dict[str, Any]:
        # As vLLM's reasoning parsers do: reasoning text apart, the think tags themselves dropped.
        if index in self._reasoning:
            return {"reasoning_content": text}
        if index < self._answer_from:
            return {"reasoning_content": ""}
        return {"content": text}

    def split(self, output: tuple[int, ...]) -> tuple[str | None, str]:
        """(reasoning, answer) texts of a chat output."""
        if not self._answer_from:
            return None, toy_tokenizer.decode(output)
        reasoning = output[self._reasoning.start : self._reasoning.stop]
        return toy_tokenizer.decode(reasoning), toy_tokenizer.decode(output[self._answer_from :])

    def chunk(self, ev: TokenEvent, first: bool) -> dict[str, Any]:
        text = toy_tokenizer.decode([ev.token_id])
        index = self._emitted
        self._emitted += 1
        fin = ev.finish
        choice: dict[str, Any]
        if self.p.chat:
            delta = self._delta(index, text)
            if first:
                delta = {"role": "assistant", **delta}
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": fin.finish_reason if fin else None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": fin.finish_reason if fin else None,
                "stop_reason": None,
            }
        if self.p.return_token_ids:
            choice["token_ids"] = [ev.token_id]
            if first and not self.p.chat:
                choice["prompt_token_ids"] = list(self.p.request.prompt_token_ids)
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.p.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if first and self.p.chat and self.p.return_token_ids:
            out["prompt_token_ids"] = list(self.p.request.prompt_token_ids)
        if fin is not None:
            out["kv_transfer_params"] = fin.kv_transfer_params
        return out

    def usage_chunk(self, fin: FinishInfo) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.p.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": _usage(
                len(self.p.request.prompt_token_ids), len(fin.output_token_ids), fin.cached_tokens
            ),
        }

    def full(self, fin: FinishInfo) -> dict[str, Any]:
        text = toy_tokenizer.decode(fin.output_token_ids)
        prompt_ids = list(self.p.request.prompt_token_ids)
        choice: dict[str, Any]
        if self.p.chat:
            reasoning, answer = self.split(fin.output_token_ids)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": answer,
                "reasoning_content": reasoning,
                "tool_calls": [],
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": fin.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": fin.finish_reason,
                "stop_reason": None,
            }
        if self.p.return_token_ids:
            choice["token_ids"] = list(fin.output_token_ids)
            if not self.p.chat:
                choice["prompt_token_ids"] = prompt_ids
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.p.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(len(prompt_ids), len(fin.output_token_ids), fin.cached_tokens),
            "kv_transfer_params": fin.kv_transfer_params,
        }
        if self.p.chat and self.p.return_token_ids:
            out["prompt_token_ids"] = prompt_ids
        return out


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error("the body is not valid JSON", 400)
    try:
        headers = request.headers
        p = parse_request(engine, body, chat, headers.get("X-Request-Id"), headers.get(SESSION_ID_HEADER))
    except RequestError as e:
        return _error(str(e), e.status, e.param)
    r = _Responder(engine, p)
    gen: AsyncIterator[TokenEvent] = engine.generate(p.request)
    if not p.stream:
        fin: FinishInfo | None = None
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for ev in gen:
                    fin = ev.finish or fin
        except KvCacheFullError as e:
            return _error(f"KV cache full: {e}", 503)
        assert fin is not None, "a finished generation always carries FinishInfo"
        return web.json_response(r.full(fin))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    first = True
    last: FinishInfo | None = None
    try:
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            async for ev in gen:
                await resp.write(b"data: " + json.dumps(r.chunk(ev, first)).encode() + b"\n\n")
                first = False
                last = ev.finish or last
    except KvCacheFullError as e:
        err = {"error": {"message": f"KV cache full: {e}", "type": "ServiceUnavailableError", "code": 503}}
        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
    except ConnectionResetError:
        return resp  # the client went away; closing the generator aborted the request
    if last is not None and p.include_usage:
        await resp.write(b"data: " + json.dumps(r.usage_chunk(last)).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != engine.settings.model:
            raise RequestError(f"The model `{model}` does not exist.", status=404, param="model")
        if "messages" in body:
            ids = _chat_ids(body)
        elif isinstance(body.get("prompt"), str):
            ids = toy_tokenizer.encode(body["prompt"], add_bos=_bool(body, "add_special_tokens", True))
        else:
            ids = _prompt_ids(engine, body.get("prompt"))
    except ValueError:
        return _error("the body is not valid JSON", 400)
    except RequestError as e:
        return _error(str(e), e.status, e.param)
    return web.json_response(
        {"count": len(ids), "max_model_len": engine.settings.max_model_len, "tokens": ids, "token_strs": None}
    )


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error("the body is not valid JSON", 400)
    tokens = body.get("tokens") if isinstance(body, dict) else None
    try:
        ids = _prompt_ids(engine, tokens)
    except RequestError as e:
        return _error(str(e), e.status, "tokens")
    return web.json_response({"prompt": toy_tokenizer.decode(ids)})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    s = request.app[ENGINE_KEY].settings
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": s.model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvplane-sim",
                    "root": s.model,
                    "parent": None,
                    "max_model_len": s.max_model_len,
                }
            ],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(
        body=engine.metrics.render(engine.load()),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def sim_state(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    s = engine.settings
    return web.json_response(
        {
            "engine_id": engine.engine_id,
            "incarnation": engine.incarnation,
            "role": s.role,
            "model": s.model,
            "bidirectional": engine.bidirectional,
            "host_tier": engine.retention.host_tier_enabled,
            "spill_order": engine.retention.spill_order(),
            "side_channel_host": s.advertised_side_channel_host,
            "side_channel_port": engine.side_channel_port,
            "block_size": s.block_size,
            "bytes_per_block": s.bytes_per_block,
            "load": dataclasses.asdict(engine.load()),
            "retained": engine.retained(),
            "kv_events": None if engine.kv_events is None else engine.kv_events.state(),
        }
    )


async def sim_timeline(request: web.Request) -> web.Response:
    """The finished requests after `since` (a seq), timed (timeline.py); `last_seq` to read on from."""
    engine = request.app[ENGINE_KEY]
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        return _error("since must be an integer", 400, "since")
    timeline = engine.timeline
    return web.json_response(
        {"last_seq": timeline.last_seq, "requests": [dataclasses.asdict(r) for r in timeline.since(since)]}
    )


async def sim_release_early(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
    except ValueError:
        return _error("the body is not valid JSON", 400)
    rid = body.get("request_id") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        return _error("request_id must be a string", 400, "request_id")
    return web.json_response({"released": engine.release_early(rid)})


async def _switch(request: web.Request) -> bool | web.Response:
    """The `{"enabled": bool}` body of a switch, or the error response to send."""
    try:
        body = await request.json()
    except ValueError:
        return _error("the body is not valid JSON", 400)
    enabled = body.get("enabled") if isinstance(body, dict) else None
    if not isinstance(enabled, bool):
        return _error("enabled must be a boolean", 400, "enabled")
    return enabled


async def sim_bidirectional(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    enabled = await _switch(request)
    if isinstance(enabled, web.Response):
        return enabled
    engine.bidirectional = enabled
    return web.json_response({"bidirectional": engine.bidirectional})


async def sim_host_tier(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    enabled = await _switch(request)
    if isinstance(enabled, web.Response):
        return enabled
    engine.set_host_tier(enabled)
    return web.json_response({"host_tier": engine.retention.host_tier_enabled})


def build_app(engine: SimEngine) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[ENGINE_KEY] = engine
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/sim/state", sim_state)
    app.router.add_get("/sim/timeline", sim_timeline)
    app.router.add_post("/sim/release_early", sim_release_early)
    app.router.add_post("/sim/bidirectional", sim_bidirectional)
    app.router.add_post("/sim/host_tier", sim_host_tier)
    app.add_routes(kv_cache_routes(engine))
    return app
