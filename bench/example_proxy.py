"""A P/D proxy built the way vLLM's disaggregated example proxy is: the baseline of gateway_bench.

    python -m kvplane.bench.example_proxy PORT --prefill URL [URL ...] --decode URL [URL ...]

vLLM's example (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) is what the gateway's
CPU target is stated against, so this module rebuilds its stack and its per-request work rather
than a leaner equivalent: a FastAPI app served by uvicorn (one worker), one `httpx.AsyncClient`
per engine (no timeout, no connection limits, base URL `<engine>/v1`) opened in the lifespan
handler, and engines taken round-robin. Per `POST /v1/completions`: the body parsed, a uuid4
request id, the P leg (`prefill_body`: `max_tokens` 1, not streamed, `do_remote_decode`) read
whole, then the D leg (`decode_body`: the request with P's `kv_transfer_params`) streamed back
chunk by chunk, as the example does, under `media_type="application/json"` (the chunks are D's
SSE lines; a client reading `data:` lines, such as `live.stream_turn`, does not look at the type).

HTTP stack: what the example gets in a vLLM environment. vLLM requires `fastapi[standard]`, whose
uvicorn brings uvloop and httptools, and the example leaves uvicorn to pick them: so uvicorn
serves on uvloop's event loop with httptools (C) parsing requests, and httpx (httpcore, h11) talks
to the engines. Access logs are off and uvicorn logs only warnings, where the example keeps
uvicorn's defaults (access log on, info): this baseline does not pay for logging that the gateway
does not do either.

Prints "ready" on stdout once it listens, for the process that started it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
import uvloop
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvplane.services.common.model.handles import fresh_prefill_params

# How often the start-up waits to see uvicorn listening, in seconds.
READY_POLL_S = 0.02


# -- the request rewriting (pure) ---------------------------------------------------


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The P leg's body: one token, not streamed, its KV kept for D.

    Streaming options and minimum lengths are dropped because P answers one token at once; the
    example proxy drops them for the same reason.
    """
    p_body = dict(body)
    # What P is told: "compute the prompt and keep its KV for a remote decode to read" (the same
    # keys as the example's).
    p_body["kv_transfer_params"] = fresh_prefill_params()
    p_body["stream"] = False
    p_body["max_tokens"] = 1
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    p_body.pop("stream_options", None)
    p_body.pop("min_tokens", None)
    p_body.pop("min_completion_tokens", None)
    return p_body


def decode_body(body: Mapping[str, Any], p_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The D leg's body: the request as the client sent it, with the KV params P answered.

    An answer without params leaves the request's own (if any), as the example does: D then
    computes the prompt itself.
    """
    d_body = dict(body)
    params = p_answer.get("kv_transfer_params")
    if params:
        d_body["kv_transfer_params"] = params
    return d_body


def engine_headers(request_id: str) -> dict[str, str]:
    """Headers of both legs; the key is read per request, as the example reads it."""
    return {
        "Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}",
        "X-Request-Id": request_id,
    }


# -- the server ---------------------------------------------------------------------


@dataclass
class EnginePool:
    """One client per engine of a role, handed out in turn."""

    urls: Sequence[str]
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    _turns: Iterator[int] = field(default_factory=lambda: iter(()))

    def open(self) -> None:
        # No timeout and no pool limits, as the example: a long decode must not be cut off.
        self.clients = [
            httpx.AsyncClient(
                timeout=None,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                base_url=f"{url.rstrip('/')}/v1",
            )
            for url in self.urls
        ]
        self._turns = itertools.cycle(range(len(self.clients)))

    def next(self) -> httpx.AsyncClient:
        return self.clients[next(self._turns)]

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()


async def _prefill(client: httpx.AsyncClient, body: Mapping[str, Any], request_id: str) -> Any:
    """P's whole answer; read before it is parsed so that the connection goes back to the pool."""
    response = await client.post("/completions", json=prefill_body(body), headers=engine_headers(request_id))
    response.raise_for_status()
    await response.aread()
    return response.json()


async def _decode_stream(
    client: httpx.AsyncClient, d_body: Mapping[str, Any], request_id: str
) -> AsyncIterator[bytes]:
    """D's answer as the bytes arrive, unparsed."""
    async with client.stream("POST", "/completions", json=d_body, headers=engine_headers(request_id)) as resp:
        resp.raise_for_status()
        async for chunk in resp.aiter_bytes():
            yield chunk


def build_app(prefills: Sequence[str], decodes: Sequence[str]) -> FastAPI:
    """The proxy's app; its clients open with the app's lifespan and close with it."""
    p_pool, d_pool = EnginePool(prefills), EnginePool(decodes)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        p_pool.open()
        d_pool.open()
        try:
            yield
        finally:
            await p_pool.close()
            await d_pool.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        request_id = str(uuid.uuid4())
        p_answer = await _prefill(p_pool.next(), body, request_id)
        d_body = decode_body(body, p_answer)
        return StreamingResponse(
            _decode_stream(d_pool.next(), d_body, request_id), media_type="application/json"
        )

    @app.get("/healthcheck")
    async def healthcheck() -> dict[str, Any]:
        return {"status": "ok", "prefill_instances": len(prefills), "decode_instances": len(decodes)}

    return app


async def serve(port: int, prefills: Sequence[str], decodes: Sequence[str]) -> None:
    """Serves until terminated; says "ready" once the socket listens."""
    config = uvicorn.Config(
        build_app(prefills, decodes),
        host="127.0.0.1",
        port=port,
        workers=1,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    # uvicorn has no start-up callback: `started` turns true once the lifespan has run and the
    # socket listens.
    while not server.started:
        if serving.done():
            await serving
            raise RuntimeError(f"uvicorn did not start on port {port}")
        await asyncio.sleep(READY_POLL_S)
    print("ready", flush=True)
    await serving


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="example_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--prefill", nargs="+", required=True, help="prefill engines' base URLs")
    parser.add_argument("--decode", nargs="+", required=True, help="decode engines' base URLs")
    args = parser.parse_args(argv)
    # uvicorn's `loop` setting applies only where uvicorn makes the loop itself (uvicorn.run);
    # here the loop is made first, as uvicorn would, on uvloop.
    uvloop.run(serve(args.port, args.prefill, args.decode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
