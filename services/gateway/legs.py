"""HTTP calls to the engines: the prefill leg (one JSON answer) and the decode leg (a stream).

Each leg has its own deadline. A failure says what happened (the engine's status, or that
nothing answered); what the turn does about it is `failover.py`'s to decide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
# How long a finished stream's end is waited for before its connection is closed, seconds.
BODY_END_WAIT_S = 0.5


def leg_path(chat: bool) -> str:
    """The engine's endpoint for a turn: chat or plain completions, as the client asked."""
    return "/v1/chat/completions" if chat else "/v1/completions"


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for an engine leg."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers)
    return headers


class LegFailed(Exception):
    """An engine leg did not produce a usable answer."""

    def __init__(
        self, leg: str, reason: str, *, status: int = 0, body: bytes = b"", unreachable: bool = False
    ) -> None:
        super().__init__(f"{leg} leg: {reason}")
        self.leg = leg
        self.reason = reason
        # The engine's HTTP status and body, when it answered at all.
        self.status = status
        self.body = body
        # Nothing answered (refused or reset connection): the engine may be down.
        self.unreachable = unreachable

    @property
    def outcome(self) -> str:
        if self.unreachable:
            return "unreachable"
        if self.status:
            return f"http_{self.status}"
        return "timeout" if "timed out" in self.reason else "error"


@dataclass(frozen=True, slots=True)
class LegTimeouts:
    connect_s: float
    # The whole leg; None: no overall limit.
    total_s: float | None
    # The longest wait for the next bytes of the answer.
    read_s: float | None = None

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.total_s, sock_connect=self.connect_s, sock_read=self.read_s)


async def post_json(
    session: aiohttp.ClientSession,
    leg: str,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    timeouts: LegTimeouts,
) -> dict[str, Any]:
    """POSTs `body` and returns the JSON object answered with 200; raises LegFailed otherwise."""
    try:
        async with session.post(
            url, data=encode_body(body), headers=_json_headers(headers), timeout=timeouts.client_timeout()
        ) as resp:
            raw = await resp.read()
            if resp.status != 200:
                raise LegFailed(leg, f"HTTP {resp.status}", status=resp.status, body=raw)
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
        raise LegFailed(leg, f"unreachable: {exc}", unreachable=True) from exc
    except TimeoutError as exc:
        raise LegFailed(leg, f"timed out after {timeouts.total_s} s") from exc
    except aiohttp.ClientError as exc:
        raise LegFailed(leg, f"failed: {exc!r}") from exc
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LegFailed(leg, "answered with invalid JSON", status=502) from exc
    if not isinstance(answer, dict):
        raise LegFailed(leg, "answered with JSON that is not an object", status=502)
    return answer


async def open_stream(
    session: aiohttp.ClientSession,
    leg: str,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    timeouts: LegTimeouts,
) -> aiohttp.ClientResponse:
    """POSTs `body` and returns the open 200 response; the caller reads and releases it."""
    try:
        resp = await session.post(
            url, data=encode_body(body), headers=_json_headers(headers), timeout=timeouts.client_timeout()
        )
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
        raise LegFailed(leg, f"unreachable: {exc}", unreachable=True) from exc
    except TimeoutError as exc:
        raise LegFailed(leg, f"timed out after {timeouts.total_s} s") from exc
    except aiohttp.ClientError as exc:
        raise LegFailed(leg, f"failed: {exc!r}") from exc
    if resp.status != 200:
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            raw = b""
        finally:
            resp.release()
        raise LegFailed(leg, f"HTTP {resp.status}", status=resp.status, body=raw)
    return resp


async def read_to_end(upstream: aiohttp.ClientResponse) -> bool:
    """Reads what a streamed answer sends after its last event: the end of its chunked body, which
    may come in a read of its own (uvicorn, under vLLM, ends a response with a write of its own).
    True when the body ended within `BODY_END_WAIT_S`: the response may then be released, and its
    connection serves the next leg; released before its end, aiohttp closes the connection."""
    try:
        async with asyncio.timeout(BODY_END_WAIT_S):
            while await upstream.content.readany():
                pass  # nothing follows `data: [DONE]` but the body's end
    except (aiohttp.ClientError, TimeoutError):
        return False
    return upstream.content.is_eof()


def encode_body(body: Mapping[str, Any]) -> bytes:
    """A leg's JSON body, encoded in C: a prompt's token ids are most of it, on every leg."""
    return orjson.dumps(body)


def _json_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {**headers, "Content-Type": "application/json"}
