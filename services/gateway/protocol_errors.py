"""Errors aiohttp answers itself, in OpenAI's JSON format like every other refusal.

Two kinds never reach a handler: a request aiohttp's parser refuses (a malformed request line
or header, a bad chunk), answered by the connection's request handler; and a path or method no
route serves (404, 405), raised by the router. The first is answered through `JsonErrorAppRunner`
(aiohttp offers no hook for the parser's answer but its request handler class); the second by the
`json_http_errors` middleware.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvplane.services.gateway.openai_errors import error_response

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


class _JsonErrorRequestHandler(RequestHandler):
    """A connection's handler whose own error answers are JSON (it always closes the connection)."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # aiohttp's own log of the failure (with its traceback), and its refusal to answer once
            # a response has started; nothing about the failure leaves the gateway.
            super().handle_error(request, status, exc, message)
            return error_response(status, "internal error", close=True)
        if request.writer.output_size > 0:
            raise ConnectionError("a response has started: no error answer can follow it")
        # The client's mistake, not the gateway's: one line, no traceback (aiohttp would log every
        # malformed request at error level, with its stack, for anyone to flood the log with).
        log.info("malformed HTTP request from %s: %s %s", request.remote, status, message or exc)
        detail = f": {message}" if message else ""
        return error_response(status, f"malformed HTTP request ({_phrase(status)}){detail}", close=True)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorAppRunner(web.AppRunner):
    """web.AppRunner whose connections answer unparsable requests in OpenAI's JSON format."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _JsonErrorServer(
            server.request_handler, request_factory=server.request_factory, **self._kwargs
        )


@web.middleware
async def json_http_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 404, 405 or other HTTP error raised by aiohttp, as an OpenAI-format JSON error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers: dict[str, Any] = {}
        if isinstance(exc, web.HTTPMethodNotAllowed):
            headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        response = error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
        response.headers.update(headers)
        return response
