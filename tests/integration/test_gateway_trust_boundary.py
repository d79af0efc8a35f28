"""The gateway's trust boundary over the real stack (etcd, metadata and routing over gRPC, sim-engines
with real NIXL): callers authenticated before their bodies are read, bodies bounded in size and time,
bad input refused with OpenAI's error format before any route or engine call, per-tenant prefix
caches, and a tenant's bounded share of the KV its turns hold.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.gateway.app import BODY_READS_KEY, LIMITS_KEY, SHARES_KEY
from tests.support.gateway_stack import MODEL, GatewayStack, gateway_stack
from tests.support.polling import eventually

VOCAB = 151_936
MAX_MODEL_LEN = 32_768


@pytest.fixture(scope="module")
async def stack(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(
        etcd, f"/kvplane-gwtb/{uuid.uuid4().hex}/", tmp_path_factory.mktemp("gwtb")
    ) as s:
        # The engines' vocabulary and context length, as a deployment configures them.
        s.gateway.settings.vocab_size = VOCAB
        s.gateway.settings.max_model_len = MAX_MODEL_LEN
        yield s


def ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30_000) for _ in range(n)]


async def routes(stack: GatewayStack) -> float:
    return await stack.gateway_metric("kvplane_gateway_leg_seconds_count", leg="route")


async def post_raw(
    stack: GatewayStack, path: str, data: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    async with stack.session.post(
        stack.gateway.url + path, data=data, headers={"Content-Type": "application/json", **headers}
    ) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else {}


def good_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids(40, 1), "max_tokens": 4, **extra}


BAD_BODIES: list[tuple[str, bytes, str | None]] = [
    ("invalid UTF-8", b'{"model": "m", "prompt": "\xff\xfe"}', None),
    ("not JSON", b"{'prompt': 1}", None),
    ("not an object", b"[1, 2, 3]", None),
    ("nested past the parser's recursion", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (
        "nested past the limit",
        json.dumps({"prompt": "x", "metadata": json.loads("[" * 40 + "]" * 40)}).encode(),
        None,
    ),
    ("a lone surrogate", b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b"}', None),
    ("a token id of 2^32", json.dumps(good_body(prompt=[1, 2, 1 << 32])).encode(), "prompt"),
    ("a token id past the vocabulary", json.dumps(good_body(prompt=[1, VOCAB])).encode(), "prompt"),
    ("a negative token id", json.dumps(good_body(prompt=[1, -1])).encode(), "prompt"),
    ("a boolean token id", json.dumps(good_body(prompt=[1, True])).encode(), "prompt"),
    ("a batch of two prompts", json.dumps(good_body(prompt=["a", "b"])).encode(), "prompt"),
    ("NaN temperature", json.dumps(good_body()).encode()[:-1] + b', "temperature": NaN}', None),
    ("a string max_tokens", json.dumps(good_body(max_tokens="7")).encode(), "max_tokens"),
    ("max_tokens past the context", json.dumps(good_body(max_tokens=40_000)).encode(), "max_tokens"),
    ("n of 2", json.dumps(good_body(n=2)).encode(), "n"),
    (
        "NUL in the conversation id",
        json.dumps(good_body(conversation_id="a\x00b")).encode(),
        "conversation_id",
    ),
    (
        "CR/LF in the conversation id",
        json.dumps(good_body(conversation_id="a\r\nSet-Cookie: x")).encode(),
        "conversation_id",
    ),
    (
        "a 600-byte conversation id",
        json.dumps(good_body(conversation_id="c" * 600)).encode(),
        "conversation_id",
    ),
]


@pytest.mark.parametrize(("case", "data", "param"), BAD_BODIES, ids=[c for c, _, _ in BAD_BODIES])
async def test_bad_input_is_a_400_in_openais_format_before_any_route_or_engine_call(
    stack: GatewayStack, case: str, data: bytes, param: str | None
) -> None:
    routed, seen = await routes(stack), len(stack.proxy.seen)
    status, answer = await post_raw(stack, "/v1/completions", data, stack.headers("acme"))
    assert status == 400, (case, answer)
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == 400 and answer["error"]["type"] == "BadRequestError"
    if param is not None:
        assert answer["error"]["param"] == param
    # Nothing reached routing or the prefill engine (tokenize included).
    assert await routes(stack) == routed and len(stack.proxy.seen) == seen


async def test_bad_chat_messages_are_refused_before_any_route(stack: GatewayStack) -> None:
    routed = await routes(stack)
    for messages in (None, [], "hi", [{"content": "no role"}], [{"role": "user", "content": 7}]):
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        result = await stack.post("/v1/chat/completions", body, stack.headers("acme"))
        assert result.status == 400 and result.body["error"]["param"].startswith("messages"), messages
    assert await routes(stack) == routed


async def test_control_characters_or_invalid_utf8_in_the_conversation_header_are_refused(
    stack: GatewayStack,
) -> None:
    routed = await routes(stack)
    host, port = "127.0.0.1", stack.gateway.port
    body = json.dumps(good_body()).encode()
    for value in (b"conv\x01x", b"conv\xff\xfe", b"conv\x7f"):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
            + stack.headers("acme")["Authorization"][7:].encode()
            + b"\r\nX-Conversation-Id: "
            + value
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=30)
        writer.close()
        # Control bytes are refused by the HTTP parser itself; invalid UTF-8 by the gateway.
        assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), (value, answer[:200])
        if value == b"conv\xff\xfe":
            assert b'"param": "conversation_id"' in answer
    assert await routes(stack) == routed


async def test_no_key_is_a_401_without_the_body_being_read(stack: GatewayStack) -> None:
    # The body declares 60 MB and sends none of it: the answer comes from the headers alone.
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 62914560\r\n\r\n"
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b'"type": "AuthenticationError"' in answer


async def test_a_declared_body_over_the_limit_is_a_413_without_being_read(stack: GatewayStack) -> None:
    assert stack.gateway._runner is not None
    limit = stack.gateway._runner.app[LIMITS_KEY].max_body_bytes
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + f"Authorization: {stack.headers('acme')['Authorization']}".encode()
        + b"\r\nContent-Length: "
        + str(limit + 1).encode()
        + b"\r\n\r\n"
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def test_a_chunked_body_growing_past_the_limit_is_a_413(stack: GatewayStack) -> None:
    assert stack.gateway._runner is not None
    limit = stack.gateway._runner.app[LIMITS_KEY].max_body_bytes

    async def chunks() -> AsyncIterator[bytes]:
        sent = 0
        while sent <= limit:
            yield b" " * (1 << 20)
            sent += 1 << 20

    async with stack.session.post(
        stack.gateway.url + "/v1/completions", data=chunks(), headers=stack.headers("acme")
    ) as resp:
        assert resp.status == 413


async def test_the_same_prompt_hits_the_prefill_cache_only_within_a_tenant(stack: GatewayStack) -> None:
    async def p_cache_hits() -> float:
        return await stack.prefill.metric(
            stack.session, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
        )

    prompt = ids(256, 77)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    first = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
    assert first.status == 200, first.raw
    before = await p_cache_hits()
    # Another tenant, the very same prompt: no hit, so its timing tells it nothing about acme.
    other = await stack.post("/v1/completions", body, stack.headers("globex", f"c-{uuid.uuid4().hex}"))
    assert other.status == 200, other.raw
    assert await p_cache_hits() == before
    # The same tenant in another conversation: its own cache serves the prefix.
    again = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
    assert again.status == 200, again.raw
    assert await p_cache_hits() >= before + 240
    # The salt is a keyed hash: it names no tenant, and a client's own salt is overwritten.
    salted = [r.body.get("cache_salt") for r in stack.proxy.seen[-3:]]
    assert salted[0] == salted[2] != salted[1]
    assert all(isinstance(s, str) and "acme" not in s and "globex" not in s for s in salted)
    forged = await stack.post(
        "/v1/completions", {**body, "cache_salt": salted[0]}, stack.headers("globex", f"c-{uuid.uuid4().hex}")
    )
    assert forged.status == 200 and stack.proxy.seen[-1].body["cache_salt"] == salted[1]


async def test_a_tenant_past_its_share_of_inflight_tokens_gets_429_and_others_are_served(
    stack: GatewayStack,
) -> None:
    assert stack.gateway._runner is not None
    app_shares = stack.gateway._runner.app[SHARES_KEY]
    previous = app_shares.limit
    app_shares.limit = 300
    try:
        stack.proxy.stall_next(3.0)  # acme's first turn holds its share while P works
        body = {"model": MODEL, "prompt": ids(200, 5), "max_tokens": 2}
        held = asyncio.create_task(
            stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
        )

        async def acme_in_flight() -> bool:
            return app_shares.in_flight("acme") == 200

        await eventually(acme_in_flight, timeout_s=10, what="acme's first turn to be in flight")
        refused = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
        assert refused.status == 429 and refused.body["error"]["type"] == "RateLimitError"
        served = await stack.post("/v1/completions", body, stack.headers("globex", f"c-{uuid.uuid4().hex}"))
        assert served.status == 200, served.raw
        assert (await held).status == 200
        assert app_shares.in_flight("acme") == 0
    finally:
        app_shares.limit = previous


async def test_a_tenant_whose_bodies_are_still_arriving_past_its_share_gets_429_and_others_are_served(
    stack: GatewayStack,
) -> None:
    """One tenant's bodies being read at once are bounded by their bytes: past its share, its next
    request is refused before its body is read, while another tenant's turn is served."""
    assert stack.gateway._runner is not None
    reads = stack.gateway._runner.app[BODY_READS_KEY]
    previous = reads.limit
    reads.limit = 1500
    _reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    try:
        # A body that declares 1,000 bytes and sends 10 of them: it holds acme's share while it trickles.
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + f"Authorization: {stack.headers('acme')['Authorization']}".encode()
            + b"\r\nContent-Length: 1000\r\n\r\n"
            + b'{"prompt":'
        )
        await writer.drain()

        async def acme_reading() -> bool:
            return reads.in_flight("acme") == 1000

        await eventually(acme_reading, timeout_s=10, what="acme's first body to be being read")
        body = {"model": MODEL, "prompt": ids(200, 7), "max_tokens": 2}
        refused = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
        assert refused.status == 429 and refused.body["error"]["type"] == "RateLimitError"
        assert "request-body bytes" in refused.body["error"]["message"]
        served = await stack.post("/v1/completions", body, stack.headers("globex", f"c-{uuid.uuid4().hex}"))
        assert served.status == 200, served.raw
    finally:
        writer.close()
        reads.limit = previous

    async def nothing_reading() -> bool:
        return reads.in_flight("acme") == 0

    # The trickling client left: its share is back (the read ends with the connection).
    await eventually(nothing_reading, timeout_s=30, what="acme's share of body reads to be freed")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_turn_d_refuses_has_ps_held_blocks_released_at_once(
    stack: GatewayStack, stream: bool
) -> None:
    async def early_frees() -> float:
        return await stack.prefill.metric(
            stack.session, "kvplane_sim_retained_frees_total", kind="prefill_lease", reason="early"
        )

    settings = stack.gateway.settings
    previous = settings.max_model_len
    # A gateway that does not know the engines' context: P (one token) accepts, D refuses.
    settings.max_model_len = 0
    try:
        before = await early_frees()
        body = {"model": MODEL, "prompt": ids(300, 9), "max_tokens": 40_000, "stream": stream}
        result = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
        assert result.status == 400, result.raw
        assert "maximum context length" in json.loads(result.raw)["error"]["message"]  # D's own refusal
        # The failed report names P's held request; the release command reaches P's agent, and P frees
        # the blocks as released early, not at the end of its lease.
        await eventually(
            lambda: _more(early_frees, before),
            timeout_s=20,
            what=f"P's held blocks to be released early (decision {result.decision})",
        )
        state = json.loads(await stack.prefill.get(stack.session, "/sim/state"))
        assert [r for r in state["retained"] if r["kind"] == "prefill_lease"] == []
    finally:
        settings.max_model_len = previous


async def _more(probe: Any, than: float) -> bool:
    return bool(await probe() > than)


async def test_a_text_prompt_too_long_once_tokenized_is_refused_before_any_route(stack: GatewayStack) -> None:
    settings = stack.gateway.settings
    # The engine's /tokenize itself (not through the recording proxy in front of P's completions).
    settings.tokenize_url = stack.prefill.url
    try:
        routed, seen = await routes(stack), len(stack.proxy.seen)
        body = {"model": MODEL, "prompt": "a question", "max_tokens": MAX_MODEL_LEN}
        result = await stack.post("/v1/completions", body, stack.headers("acme", f"c-{uuid.uuid4().hex}"))
        assert result.status == 400 and result.body["error"]["param"] == "max_tokens", result.raw
        assert await routes(stack) == routed and len(stack.proxy.seen) == seen
    finally:
        settings.tokenize_url = ""


async def test_a_client_waiting_for_100_continue_gets_it_only_once_admitted(stack: GatewayStack) -> None:
    async def head(extra: bytes, length: int = 62914560) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {length}\r\nExpect: 100-continue\r\n".encode()
            + extra
            + b"\r\n"
        )
        await writer.drain()
        first = await asyncio.wait_for(reader.readline(), timeout=30)
        writer.close()
        return first

    # No key: the 401 comes instead of leave to send the body.
    assert (await head(b"")).startswith(b"HTTP/1.1 401")
    key = f"Authorization: {stack.headers('acme')['Authorization']}\r\n".encode()
    # Admitted but declared too large: refused before any of the body is asked for.
    assert (await head(key)).startswith(b"HTTP/1.1 413")
    assert (await head(key, length=100)).startswith(b"HTTP/1.1 100 Continue")


async def _raw_exchange(stack: GatewayStack, request: bytes) -> tuple[bytes, dict[str, Any]]:
    """Sends `request` as it is; the answer's status line and its JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.gateway.port)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=30)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    parsed: dict[str, Any] = json.loads(body)
    return head.split(b"\r\n")[0], parsed


MALFORMED_REQUESTS: list[tuple[str, bytes]] = [
    ("a garbage request line", b"\x16\x03\x01 not http at all\r\n\r\n"),
    ("an unreadable HTTP version", b"GET /health HTTP/x.y\r\nHost: gw\r\n\r\n"),
    ("a header without a colon", b"GET /health HTTP/1.1\r\nHost: gw\r\nno colon here\r\n\r\n"),
    ("an invalid Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n"),
    (
        "a bad chunk size",
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ),
]


@pytest.mark.parametrize(
    ("case", "request_bytes"), MALFORMED_REQUESTS, ids=[c for c, _ in MALFORMED_REQUESTS]
)
async def test_a_request_the_http_parser_refuses_gets_a_400_in_openais_format(
    stack: GatewayStack, case: str, request_bytes: bytes
) -> None:
    status_line, body = await _raw_exchange(stack, request_bytes)
    # HTTP/1.0 when even the version could not be read.
    assert status_line.split()[1].startswith(b"4"), (case, status_line)
    assert body["error"]["type"] in ("BadRequestError", "RequestTooLargeError", "NotImplementedError"), body
    assert body["error"]["code"] == int(status_line.split()[1])


async def test_unknown_paths_and_methods_get_openai_format_errors(stack: GatewayStack) -> None:
    status_line, body = await _raw_exchange(
        stack, b"GET /v1/nothing-here HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
    )
    assert status_line.startswith(b"HTTP/1.1 404") and body["error"]["type"] == "NotFoundError"
    async with stack.session.delete(stack.gateway.url + "/v1/models", headers=stack.headers("acme")) as resp:
        assert resp.status == 405 and "GET" in resp.headers["Allow"]
        assert (await resp.json())["error"]["code"] == 405


async def test_the_model_list_needs_an_api_key(stack: GatewayStack) -> None:
    async with stack.session.get(stack.gateway.url + "/v1/models") as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["type"] == "AuthenticationError"
    async with stack.session.get(
        stack.gateway.url + "/v1/models", headers={"Authorization": "Bearer not-a-key"}
    ) as resp:
        assert resp.status == 401
    async with stack.session.get(stack.gateway.url + "/v1/models", headers=stack.headers("acme")) as resp:
        assert resp.status == 200
        assert (await resp.json())["object"] == "list"
    # Probes and scrapers carry no key.
    async with stack.session.get(stack.gateway.url + "/health") as resp:
        assert resp.status == 200


async def test_a_malformed_request_is_logged_in_one_line_not_as_a_server_error(
    stack: GatewayStack, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        status_line, _ = await _raw_exchange(stack, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert status_line.split()[1] == b"400"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert any("malformed HTTP request" in r.getMessage() and r.exc_info is None for r in caplog.records)


async def test_a_rewritten_api_key_file_is_used_without_a_restart(tmp_path: Path) -> None:
    from kvplane.services.common.runtime.telemetry import Telemetry
    from kvplane.services.gateway.app import Gateway
    from kvplane.services.gateway.settings import GatewaySection

    keys = tmp_path / "api-keys.json"

    def write(token: str) -> None:
        keys.write_text(json.dumps([{"token": token, "tenant": "acme"}]))
        later = keys.stat().st_mtime + 5  # whatever the file system's clock resolution
        os.utime(keys, (later, later))

    write("key-before-rotation")
    settings = GatewaySection(listen="127.0.0.1:0", models=[MODEL], api_keys_file=str(keys))
    gateway = Gateway(settings, Telemetry.disabled())
    await gateway.start()
    try:
        async with aiohttp.ClientSession() as session:

            async def status(key: str) -> int:
                url = gateway.url + "/v1/models"
                async with session.get(url, headers={"Authorization": f"Bearer {key}"}) as resp:
                    return resp.status

            assert await status("key-before-rotation") == 200
            write("key-after-rotation")

            async def rotated() -> bool:
                return await status("key-after-rotation") == 200

            await eventually(rotated, what="the rotated API key accepted")
            assert await status("key-before-rotation") == 401
    finally:
        await gateway.stop()
