"""The gateway's HTTP parts on their own, over real loopback HTTP: admission before the body is read,
the body reader's limits, JSON answers to what aiohttp refuses itself, the engine legs, the engines'
/tokenize client, and the HTTPS certificate that reloads when its files change."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from kvplane.services.client.tokenize import TokenizeFailed, tokenize, tokenize_request
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.gateway.admission import TENANT, ReadLimits, admission, json_body
from kvplane.services.gateway.failover import rejected_by_engine
from kvplane.services.gateway.https import ServerCertificate
from kvplane.services.gateway.identity import ApiKeys
from kvplane.services.gateway.legs import LegFailed, LegTimeouts, open_stream, post_json
from kvplane.services.gateway.protocol_errors import JsonErrorAppRunner, json_http_errors
from tests.support.certificates import TestCa

LIMITS = ReadLimits(max_body_bytes=1024, body_timeout_s=5.0, max_depth=4)
TIMEOUTS = LegTimeouts(connect_s=5.0, total_s=10.0)


async def _echo(request: web.Request) -> web.StreamResponse:
    body = await json_body(request, LIMITS)
    if isinstance(body, web.Response):
        return body
    return web.json_response({"tenant": request[TENANT], "body": body})


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _serve(app: web.Application) -> tuple[str, web.AppRunner]:
    runner = JsonErrorAppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


@pytest.fixture
async def front() -> AsyncIterator[str]:
    """An app guarded as the gateway guards its completions route."""
    keys = ApiKeys({"key-acme": "acme"})
    app = web.Application(middlewares=[json_http_errors, admission(keys, LIMITS, frozenset({"/v1/echo"}))])
    app.router.add_post("/v1/echo", _echo)
    app.router.add_get("/health", _ok)
    url, runner = await _serve(app)
    try:
        yield url
    finally:
        await runner.cleanup()


async def _post(url: str, data: bytes, key: str | None = "key-acme") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    async with aiohttp.ClientSession() as session, session.post(url, data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


# --- admission and the body reader --------------------------------------------------------------


async def test_an_admitted_request_carries_its_keys_tenant(front: str) -> None:
    assert await _post(f"{front}/v1/echo", b'{"a": [1, {"b": 2}]}') == (
        200,
        {"tenant": "acme", "body": {"a": [1, {"b": 2}]}},
    )


async def test_a_request_without_a_valid_key_is_refused_before_its_body(front: str) -> None:
    status, answer = await _post(f"{front}/v1/echo", b"{}", key=None)
    assert status == 401 and "missing API key" in answer["error"]["message"]
    assert (await _post(f"{front}/v1/echo", b"{}", key="wrong"))[0] == 401
    async with aiohttp.ClientSession() as session, session.get(f"{front}/health") as resp:
        assert resp.status == 200, "unguarded paths pass untouched"


async def test_a_body_declared_over_the_limit_is_refused_unread(front: str) -> None:
    status, answer = await _post(f"{front}/v1/echo", b"[" + b"1," * 600 + b"1]")
    assert status == 413 and "the limit is 1024" in answer["error"]["message"]


@pytest.mark.parametrize("body", [gzip.compress(b'{"prompt": [' + b"0," * 50_000 + b"0]}"), b'{"plain": 1}'])
async def test_a_compressed_body_is_refused_unread_and_a_mislabelled_one_is_no_500(
    front: str, body: bytes
) -> None:
    # 100 KB of token ids gzip to a few hundred bytes: a body's inflation would be the attacker's
    # lever. A plain body sent as gzip used to get a 500 and an error-level traceback.
    headers = {
        "Content-Type": "application/json",
        "Authorization": "Bearer key-acme",
        "Content-Encoding": "gzip",
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{front}/v1/echo", data=body, headers=headers) as resp,
    ):
        answer = await resp.json(content_type=None)
    assert resp.status == 415 and "not accepted" in answer["error"]["message"]
    assert answer["error"]["type"] == "UnsupportedMediaTypeError"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\xff{}", "not valid UTF-8"),
        (b"{", "not valid JSON"),
        (b'{"x": NaN}', "NaN is not a JSON number"),
        (b'{"a": [[[[1]]]]}', "nests deeper than 4 levels"),
        (b'{"x": "\\ud800"}', "lone surrogate"),
        (b'{"seed": 1180591620717411303424}', "the integer 1180591620717411303424, beyond 64 bits"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
async def test_every_malformed_body_is_a_400_saying_why(front: str, body: bytes, says: str) -> None:
    status, answer = await _post(f"{front}/v1/echo", body)
    assert status == 400 and says in answer["error"]["message"]


async def test_unknown_paths_and_methods_are_answered_in_json(front: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{front}/nowhere") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == 404
        async with session.get(f"{front}/v1/echo", headers={"Authorization": "Bearer key-acme"}) as resp:
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            error = (await resp.json())["error"]
            # The client's error, typed as such, not as the gateway's (BadGatewayError).
            assert error["code"] == 405 and error["type"] == "MethodNotAllowedError"


async def test_a_malformed_request_line_is_answered_in_json(front: str) -> None:
    host, port = front.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GARBAGE\x01 / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400"
    assert json.loads(body)["error"]["message"].startswith("malformed HTTP request (Bad Request)")


# --- the engine legs ----------------------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    async def answer(request: web.Request) -> web.StreamResponse:
        kind = (await request.json())["answer"]
        if kind == "ok":
            return web.json_response({"id": "cmpl-1"})
        if kind == "list":
            return web.json_response([1])
        if kind == "garbage":
            return web.Response(text="not json")
        return web.json_response({"error": "no"}, status=int(kind))

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    url, runner = await _serve(app)
    try:
        yield f"{url}/v1/completions"
    finally:
        await runner.cleanup()


async def _leg(url: str, answer: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        return await post_json(session, "prefill", url, {"answer": answer}, {}, TIMEOUTS)


async def test_a_leg_returns_the_engines_json_object(engine: str) -> None:
    assert await _leg(engine, "ok") == {"id": "cmpl-1"}


async def test_a_client_error_is_not_retried_and_a_server_error_is(engine: str) -> None:
    with pytest.raises(LegFailed) as client_error:
        await _leg(engine, "400")
    assert (client_error.value.status, client_error.value.outcome) == (400, "http_400")
    assert rejected_by_engine(client_error.value.status)
    assert client_error.value.body == b'{"error": "no"}'
    with pytest.raises(LegFailed) as server_error:
        await _leg(engine, "503")
    assert (
        not rejected_by_engine(server_error.value.status)
        and str(server_error.value) == "prefill leg: HTTP 503"
    )


async def test_an_answer_that_is_no_json_object_is_a_bad_gateway(engine: str) -> None:
    for answer in ("garbage", "list"):
        with pytest.raises(LegFailed) as raised:
            await _leg(engine, answer)
        assert raised.value.status == 502


async def test_an_engine_that_is_not_there_is_unreachable() -> None:
    with pytest.raises(LegFailed) as raised:
        await _leg(f"http://127.0.0.1:{free_port()}/v1/completions", "ok")
    assert raised.value.unreachable and raised.value.outcome == "unreachable"
    assert not rejected_by_engine(raised.value.status)


async def test_a_stream_leg_hands_back_the_open_response_or_fails_with_the_status(engine: str) -> None:
    async with aiohttp.ClientSession() as session:
        resp = await open_stream(session, "decode", engine, {"answer": "ok"}, {}, TIMEOUTS)
        try:
            assert resp.status == 200 and await resp.json() == {"id": "cmpl-1"}
        finally:
            resp.release()
        with pytest.raises(LegFailed) as raised:
            await open_stream(session, "decode", engine, {"answer": "500"}, {}, TIMEOUTS)
        assert raised.value.status == 500 and raised.value.leg == "decode"


# --- the engines' /tokenize ---------------------------------------------------------------------


@pytest.fixture
async def tokenizer() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body.get("model") == "unknown":
            return web.json_response(
                {"error": {"message": "The model `unknown` does not exist."}}, status=404
            )
        if body.get("model") == "broken":
            return web.json_response({"tokens": ["a"]})
        return web.json_response({"tokens": [5, 6, 7], "count": 3})

    app = web.Application()
    app.router.add_post("/tokenize", answer)
    url, runner = await _serve(app)
    try:
        yield url, seen
    finally:
        await runner.cleanup()


async def test_a_chat_is_tokenized_from_its_messages(tokenizer: tuple[str, list[dict[str, Any]]]) -> None:
    url, seen = tokenizer
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        assert await tokenize(session, url + "/", body, chat=True, timeout_s=10) == (5, 6, 7)
    assert seen == [tokenize_request(body, chat=True)]
    assert seen[0]["messages"] == body["messages"] and seen[0]["add_generation_prompt"] is True


async def test_a_batch_of_one_prompt_is_the_prompt(tokenizer: tuple[str, list[dict[str, Any]]]) -> None:
    assert tokenize_request({"model": "m", "prompt": ["once"]}, chat=False) == {
        "model": "m",
        "prompt": "once",
    }


def test_the_bodys_add_special_tokens_reaches_tokenize() -> None:
    # The ids replace a completions prompt's text: they must be the ones the engine would make of it.
    bare = tokenize_request({"model": "m", "prompt": "once", "add_special_tokens": False}, chat=False)
    assert bare == {"model": "m", "prompt": "once", "add_special_tokens": False}
    chat = {"model": "m", "messages": [], "add_special_tokens": True}
    assert tokenize_request(chat, chat=True)["add_special_tokens"] is True


async def test_an_unknown_model_and_an_answer_without_token_ids_fail(
    tokenizer: tuple[str, list[dict[str, Any]]],
) -> None:
    url, _ = tokenizer
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TokenizeFailed) as unknown:
            await tokenize(session, url, {"model": "unknown", "prompt": "x"}, chat=False, timeout_s=10)
        assert unknown.value.status == 404 and unknown.value.unknown_model
        with pytest.raises(TokenizeFailed, match="no token ids"):
            await tokenize(session, url, {"model": "broken", "prompt": "x"}, chat=False, timeout_s=10)
        with pytest.raises(TokenizeFailed) as absent:
            await tokenize(
                session, f"http://127.0.0.1:{free_port()}", {"prompt": "x"}, chat=False, timeout_s=10
            )
        assert absent.value.status == 0 and not absent.value.unknown_model


# --- HTTPS --------------------------------------------------------------------------------------


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


def _serial(cert_file: str) -> int:
    return x509.load_pem_x509_certificate(Path(cert_file).read_bytes()).serial_number


async def test_the_https_certificate_reloads_when_its_files_change(tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    first = ca.issue("gateway", server=True)
    certificate = ServerCertificate(first.cert_file, first.key_file)
    assert not certificate.reload_if_changed(), "nothing changed yet"

    app = web.Application()
    app.router.add_get("/health", _ok)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=certificate.context).start()
    try:
        assert await _served_serial(port, ca) == _serial(first.cert_file)

        second = ca.issue("gateway-next", server=True)
        os.replace(second.cert_file, first.cert_file)
        os.replace(second.key_file, first.key_file)
        later = os.stat(first.cert_file).st_mtime + 5  # a coarse file system clock must still see it
        os.utime(first.cert_file, (later, later))
        os.utime(first.key_file, (later, later))
        assert certificate.reload_if_changed()
        assert await _served_serial(port, ca) == _serial(first.cert_file)
    finally:
        await runner.cleanup()


async def test_a_half_written_certificate_keeps_the_old_one_serving(tmp_path: Path) -> None:
    ca = TestCa(tmp_path)
    issued = ca.issue("gateway", server=True)
    certificate = ServerCertificate(issued.cert_file, issued.key_file)
    _write(issued.cert_file, "-----BEGIN CERTIFICATE-----\n")
    later = os.stat(issued.cert_file).st_mtime + 5
    os.utime(issued.cert_file, (later, later))
    assert not certificate.reload_if_changed()


async def _served_serial(port: int, ca: TestCa) -> int:
    context = ssl.create_default_context(cafile=ca.ca_file)
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="localhost")
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        return x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True)).serial_number
    finally:
        writer.close()
