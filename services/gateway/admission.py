"""What a request must pass before the gateway reads its body, and how the body is read.

An unauthenticated client must cost the gateway no more than its headers:
the API key is checked from the headers and the declared size against the
limit, and only then is the body read, bounded in size and in time. A
refused request's connection is closed rather than drained, so a 60 MB body
that was never going to be read is never received either (aiohttp would
otherwise read and discard it to keep the connection alive).

The head of a request has its own deadline: aiohttp closes a connection that
has not completed a request head within its keep-alive timeout, which the
gateway sets to `header_timeout_s` (app.py).

Reading turns every way a body can be malformed into a 4xx: invalid UTF-8,
invalid JSON, NaN or Infinity, nesting deeper than the limit, and escaped
lone surrogates (valid JSON, but no UTF-8 encoding exists for them, and an
engine call would fail on them later).

A body's parse is bounded before it starts. Parsing runs on the event loop, and moving it to a
thread would not help: the parser holds the GIL for the whole call, so every other request would
wait just the same. What bounds it is the number of values it may build: a body of 16 MiB can hold
8 million token ids (seconds of CPU and most of a GiB), while a prompt cannot usefully hold more
than the context length. So the body's separators (`,`, `[`, `{`) are counted first, in C and at
memory speed, and a body with more than `max_values` is refused (413) before `json.loads` sees it.
The count is an upper bound (a comma inside a string counts too), so the limit is set well above
what any legitimate body holds: twice the context length plus 65,536 (`read_limits`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import HttpVersion11, web

from kvplane.services.gateway.identity import ApiKeys, Unauthorized
from kvplane.services.gateway.openai_errors import RequestRejected, error_response, rejection
from kvplane.services.gateway.request_body import MAX_PROMPT_TOKENS
from kvplane.services.gateway.settings import GatewaySection

# The tenant the request's API key names, set before its handler runs.
TENANT: web.RequestKey[str] = web.RequestKey("kvplane_tenant", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_values_for_context(max_model_len: int) -> int:
    """The default value cap: twice the context length plus 65,536 (a prompt of token ids at the
    context length, messages, settings, and commas inside text, with room to spare); without a
    known context length, twice `MAX_PROMPT_TOKENS` plus 65,536."""
    return 2 * (max_model_len or MAX_PROMPT_TOKENS) + (1 << 16)


DEFAULT_MAX_VALUES = json_values_for_context(0)
# A body's size without a known context length.
DEFAULT_MAX_BODY_BYTES = 16 << 20


def body_bytes_for_context(max_model_len: int) -> int:
    """The default body size limit: 32 bytes a token of context (the longest token id with its
    comma is 11 bytes; a text token is a few characters, up to 6 bytes each once JSON-escaped)
    plus 1 MiB for the rest of the body; DEFAULT_MAX_BODY_BYTES without a known context length."""
    return 32 * max_model_len + (1 << 20) if max_model_len else DEFAULT_MAX_BODY_BYTES


# Bodies up to this size are parsed without counting first: their parse is cheap whatever they hold.
_COUNT_FROM_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class ReadLimits:
    # Largest body accepted, bytes.
    max_body_bytes: int
    # The whole body must arrive within this, seconds.
    body_timeout_s: float
    # Deepest nesting of JSON arrays and objects accepted.
    max_depth: int
    # Most JSON values a body may hold, counted before it is parsed (see the module's docstring).
    max_values: int = DEFAULT_MAX_VALUES
    # Most bytes of one tenant's bodies being read and parsed at once (0: unbounded).
    max_tenant_body_bytes: int = 0

    def declared_bytes(self, content_length: int | None) -> int:
        """What a body counts against its tenant's share while it is read: its declared length,
        else the most a body may be."""
        return content_length if content_length is not None else self.max_body_bytes


def read_limits(settings: GatewaySection) -> ReadLimits:
    """The body limits of a front with these gateway settings (the gateway, the picker, the sidecar)."""
    values = settings.max_json_values or json_values_for_context(settings.max_model_len)
    size = settings.max_body_bytes or body_bytes_for_context(settings.max_model_len)
    per_tenant = settings.max_body_bytes_per_tenant or 4 * size
    return ReadLimits(size, settings.body_timeout_s, settings.max_json_depth, values, per_tenant)


def _refusal(request: web.Request, keys: ApiKeys, limits: ReadLimits) -> web.Response | None:
    """The answer to a request refused on its headers alone; None, with its tenant set, if admitted."""
    try:
        request[TENANT] = keys.tenant(request.headers)
    except Unauthorized as exc:
        return error_response(401, str(exc), close=request.body_exists)
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        return error_response(
            413, f"the body is {declared} bytes; the limit is {limits.max_body_bytes}", close=True
        )
    return None


def admission(keys: ApiKeys, limits: ReadLimits, guarded: frozenset[str]) -> Any:
    """A middleware that authenticates and size-checks requests to `guarded` paths before their
    handlers run; every other path (health, metrics, models) passes untouched."""

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in guarded:
            return await handler(request)
        return _refusal(request, keys, limits) or await handler(request)

    return admit


def expect_continue(
    keys: ApiKeys, limits: ReadLimits
) -> Callable[[web.Request], Awaitable[web.Response | None]]:
    """The `Expect: 100-continue` handler of the guarded routes: a client that waits for leave to
    send its body gets it only once admitted; otherwise the refusal comes instead, and no body."""

    async def expect(request: web.Request) -> web.Response | None:
        refused = _refusal(request, keys, limits)
        if refused is not None:
            return refused
        if request.version == HttpVersion11:
            if request.headers.get("Expect", "").lower() != "100-continue":
                return error_response(417, "only Expect: 100-continue is understood", close=True)
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            # The interim answer is not part of the response's size.
            request.writer.output_size = 0
        return None

    return expect


# A request body's Content-Encoding the gateway accepts: none. A compressed body costs its size in
# inflation and parsing for a few bytes on the wire (16 MiB of token ids gzip to 16 KB), and no
# OpenAI client compresses requests.
_IDENTITY = ("", "identity")


async def read_json(request: web.Request, limits: ReadLimits) -> Any:
    """The request's JSON body, within the size, time and nesting limits; raises RequestRejected."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in _IDENTITY:
        raise RequestRejected(
            415, f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed"
        )
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise RequestRejected(408, f"the body did not arrive within {limits.body_timeout_s} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestRejected(413, f"the body is over the limit of {limits.max_body_bytes} bytes") from None
    return parse_json(raw, limits)


def parse_json(raw: bytes, limits: ReadLimits) -> Any:
    """A whole body's JSON value, within the nesting limit; raises RequestRejected (400) for every
    way it can be malformed, and 413 for one that holds more values than the limit. For any front
    that has the body's bytes in hand."""
    if len(raw) > _COUNT_FROM_BYTES:
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
        if values > limits.max_values:
            raise RequestRejected(
                413,
                f"the body holds about {values} JSON values; the limit is {limits.max_values} "
                "(set from the engines' context length)",
            )
    try:
        # orjson: strict JSON (no NaN or Infinity, no lone surrogate escapes), in C: the
        # prompt's thousands of token ids are most of a body.
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise RequestRejected(400, f"the body is not valid UTF-8 (byte {bad.start})") from None
        if "surrogate" in str(exc):
            raise RequestRejected(400, "the body holds a lone surrogate escape: not valid UTF-8") from None
        if (constant := _constant_at(raw, exc.pos)) is not None:
            raise RequestRejected(
                400, f"the body is not valid JSON: {constant} is not a JSON number"
            ) from None
        if "depth limit" in str(exc):
            raise RequestRejected(400, f"the body nests deeper than {limits.max_depth} levels") from None
        raise RequestRejected(400, f"the body is not valid JSON: {exc}") from None
    _check_depth(raw, value, limits.max_depth)
    _check_integers(raw)
    return value


def _check_integers(raw: bytes) -> None:
    """Refuses an integer beyond 64 bits, which orjson reads as a float: the client's value would
    reach the engines changed. No field an engine takes holds one. Only a body with a run of 19
    or more digits (in a string, or a number that may be one) is read again, by the standard
    library, whose integers are exact."""
    # Every digit as 0, then one substring search: both in C, some 30 us for 5,500 token ids,
    # where a regular expression took 0.7 ms.
    if _LONG_DIGITS not in raw.translate(_DIGITS_AS_ZERO):
        return
    # orjson has parsed it: no number here passes a double's range, nor the interpreter's digit limit.
    stack = [json.loads(raw)]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif type(item) is int and not _MIN_INT <= item <= _MAX_INT:
            shown = str(item)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise RequestRejected(
                400, f"the body holds the integer {shown}, beyond 64 bits: no engine takes it"
            )


# Where an integer beyond 64 bits may be (19 digits in a row); the range orjson reads exactly
# (int64 and uint64).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19
_MIN_INT, _MAX_INT = -(1 << 63), (1 << 64) - 1


def _constant_at(raw: bytes, pos: int) -> str | None:
    """The non-JSON number (NaN, Infinity, -Infinity) where parsing stopped, if that is what it was."""
    for constant in ("-Infinity", "Infinity", "NaN"):
        for at in (pos - 1, pos):
            if at >= 0 and raw.startswith(constant.encode(), at):
                return constant
    return None


# Values that hold no others: a list of only these needs no look inside.
_LEAVES = frozenset({int, float, str, bool, type(None)})
# Up to this many arrays and objects, a body's nesting is found by walking its values; past it, from
# its bytes (a walk of 65,536 empty arrays would hold the event loop for tens of milliseconds).
_WALK_CONTAINERS = 4096
# A body's brackets alone, `{}` read as `[]` (bytes.translate: in C).
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _check_depth(raw: bytes, value: Any, max_depth: int) -> None:
    """Nesting depth of a body that parsed, without recursion and without a Python step per value
    where the body holds many arrays and objects."""
    # Every array and object opens with a bracket (some brackets are inside strings): an upper
    # bound on how many there are, and so on how deep they nest.
    containers = raw.count(b"[") + raw.count(b"{")
    if containers <= max_depth:
        return
    deeper = (
        _walk_deeper(value, max_depth) if containers <= _WALK_CONTAINERS else _bytes_deeper(raw, max_depth)
    )
    if deeper:
        raise RequestRejected(400, f"the body nests deeper than {max_depth} levels")


def _walk_deeper(value: Any, max_depth: int) -> bool:
    if not isinstance(value, list | dict):
        return False
    stack: list[tuple[list[Any] | dict[str, Any], int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        # A list of token ids is checked in C (the set of its types), not item by item.
        if _LEAVES.issuperset(map(type, children)):
            continue
        stack.extend((child, depth + 1) for child in children if isinstance(child, list | dict))
    return False


def _bytes_deeper(raw: bytes, max_depth: int) -> bool:
    """From the bytes, in C: the strings removed, the brackets that remain are balanced (the body
    parsed); each pass removes the innermost pairs, so they are gone within `max_depth` passes
    unless they nest deeper."""
    brackets = _outside_strings(raw).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(max_depth):
        brackets = brackets.replace(b"[]", b"")
        if not brackets:
            return False
    return True


def _outside_strings(raw: bytes) -> bytes:
    """The bytes of a valid JSON text that lie outside its strings. Every backslash is inside a
    string and starts a two-byte escape, read left to right as `bytes.replace` reads: with the
    escaped backslashes then the escaped quotes gone, each `"` opens or closes a string."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(unescaped.split(b'"')[::2])


async def json_body(request: web.Request, limits: ReadLimits) -> dict[str, Any] | web.Response:
    """The body as a JSON object, or the error answer to send instead."""
    try:
        body = await read_json(request, limits)
    except RequestRejected as exc:
        # A body cut short by its limits may still be arriving: end the connection, never drain it.
        return rejection(exc, close=exc.status in (408, 413))
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object")
    return body
