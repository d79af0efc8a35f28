"""The sidecar's HTTP server: the two completion routes and /health."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.epp.destinations import ATTEMPT_HEADER, RETRY_ELSEWHERE
from kvplane.services.gateway import failover, sse
from kvplane.services.gateway.admission import parse_json, read_limits
from kvplane.services.gateway.app import split_host_port
from kvplane.services.gateway.decode_leg import end_with_error
from kvplane.services.gateway.legs import LegFailed, read_to_end
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected, error_response, rejection
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.turn_errors import CLIENT_GONE, TurnFailed
from kvplane.services.sidecar.answer_report import AnswerAccount, post_report
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.settings import SidecarSection
from kvplane.services.sidecar.signed_route import (
    PREFILL_REPORT_HEADER,
    PREFILLER_HEADER,
    ROUTE_HEADER,
    BadRoute,
    SignedRoute,
    host_port,
    verify,
)
from kvplane.services.sidecar.turn import DecodeRequest, SidecarLegs

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_HANDLE_KEY = b'"kv_transfer_params"'
# A signed route names P's blocks: larger than aiohttp's default header limit (8 KiB).
_MAX_FIELD_BYTES = 1 << 20


class Sidecar:
    """The sidecar's server and engine session; start() and stop() bracket its life."""

    def __init__(self, settings: SidecarSection, limits: GatewaySection, telemetry: Telemetry | None = None):
        self.settings = settings
        self.limits = limits
        self._read_limits = read_limits(limits)
        self.telemetry = telemetry or Telemetry.create("kvplane-sidecar")
        self._key = settings.route_key.get_secret_value().encode()
        # The gateway's metrics, of the legs this sidecar runs (the picker counts the turns).
        self.metrics = GatewayMetrics.create(self.telemetry.registry)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self.legs: SidecarLegs | None = None
        # Answer reports sent after their turn's task ended (the client left).
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        server = self._site._server if self._site is not None else None  # aiohttp has no public getter
        if isinstance(server, asyncio.Server) and server.sockets:
            return int(server.sockets[0].getsockname()[1])
        return split_host_port(self.settings.listen)[1]

    @property
    def address(self) -> str:
        host = split_host_port(self.settings.listen)[0]
        return f"{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        host, port = split_host_port(self.settings.listen)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.legs = SidecarLegs(
            self.limits, self.settings.decode_url, self._session, self.telemetry.tracer, self.metrics
        )
        app = web.Application(client_max_size=self._read_limits.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, max_field_size=_MAX_FIELD_BYTES
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port)
        await self._site.start()
        log.info("sidecar serving", extra={"address": self.address, "decode": self.settings.decode_url})

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = self._site = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        body = generate_latest(self.telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat=False)

    def _signed(self, request: web.Request, raw: bytes) -> SignedRoute | None:
        """The picker's route, when the request carries one that verifies; None otherwise."""
        header = request.headers.get(ROUTE_HEADER)
        if not header:
            return None
        try:
            return verify(self._key, header, body=raw, now=time.time())
        except (BadRoute, ValueError, KeyError, TypeError) as exc:
            log.warning("route header refused, serving with the decode engine alone: %s", exc)
            return None

    async def _turn(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        limits = self._read_limits
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                raw = await request.read()
            body = parse_json(raw, limits)
        except TimeoutError:
            return error_response(408, "the body did not arrive in time", close=True)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"the body is over {limits.max_body_bytes} bytes", close=True)
        except RequestRejected as exc:
            return rejection(exc)
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        signed = self._signed(request, raw)
        parent = _PROPAGATOR.extract(request.headers)
        assert self.legs is not None
        with self.telemetry.tracer.start_as_current_span(
            "sidecar.turn", context=parent, kind=trace.SpanKind.SERVER
        ):
            try:
                decode = await self._prefill(request, signed, body, chat)
            except TurnFailed as exc:
                return _failed(exc.status, exc.message, exc.body, None)
            # The picker reads D's answer itself (from Envoy's response phase) unless the route
            # asks this sidecar to report it; a request without a route keeps no handle at all.
            reports = signed is not None and bool(signed.answer_to)
            account = AnswerAccount(signed, decode.report, arrival) if signed and reports else None
            keep_handle = signed is not None and account is None
            if body.get("stream") is True:
                return await self._stream(request, decode, chat, keep_handle=keep_handle, account=account)
            return await self._whole(request, decode, chat, keep_handle=keep_handle, account=account)

    async def _prefill(
        self, request: web.Request, signed: SignedRoute | None, body: dict[str, Any], chat: bool
    ) -> DecodeRequest:
        assert self.legs is not None
        if signed is not None and signed.route.on_decode:
            # Routing chose this D, which holds the conversation's KV, to prefill the turn itself.
            return DecodeRequest(self.legs.on_decode(body, signed), None)
        prefiller = request.headers.get(PREFILLER_HEADER, "")
        if signed is None or not prefiller:
            return DecodeRequest(self.legs.alone(body, signed), None)
        if prefiller != host_port(signed.route.prefill.http_url):
            log.warning("x-prefiller-host-port %r is not the signed route's P: serving D alone", prefiller)
            return DecodeRequest(self.legs.alone(body, signed), None)
        return await self.legs.prefill(signed, body, chat)

    async def _whole(
        self,
        request: web.Request,
        decode: DecodeRequest,
        chat: bool,
        *,
        keep_handle: bool,
        account: AnswerAccount | None,
    ) -> web.StreamResponse:
        assert self.legs is not None
        try:
            answer = await self.legs.decode_whole(decode.body, chat)
        except LegFailed as exc:
            return _decode_failed(request, exc, decode.report)
        headers = _report_headers(decode.report)
        if account is not None:
            raw = account.whole(answer)
            await self._report(account)
            return web.Response(body=raw, content_type="application/json", headers=headers)
        if not keep_handle:
            answer.pop("kv_transfer_params", None)
        return web.json_response(answer, headers=headers)

    async def _report(self, account: AnswerAccount, error: str = "") -> None:
        assert self._session is not None
        account.reported = True
        report = account.report(error)
        await post_report(
            self._session, account.signed.answer_to, self._key, report, self.limits.report_timeout_s
        )

    async def _stream(
        self,
        request: web.Request,
        decode: DecodeRequest,
        chat: bool,
        *,
        keep_handle: bool,
        account: AnswerAccount | None,
    ) -> web.StreamResponse:
        assert self.legs is not None
        start = time.perf_counter()
        try:
            upstream = await self.legs.decode_stream(decode.body, chat)
        except LegFailed as exc:
            self.metrics.legs.labels("decode", exc.outcome).observe(time.perf_counter() - start)
            return _decode_failed(request, exc, decode.report)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_report_headers(decode.report),
            }
        )
        ended, outcome = False, "ok"
        try:
            await response.prepare(request)
            if account is not None:
                await self._relay_reported(response, upstream, account)
            else:
                parser = sse.SseParser()
                async for chunk in upstream.content.iter_any():
                    # The picker reads D's handle from the stream; without one, nobody may see it.
                    out = chunk if keep_handle else _without_handle(parser.feed(chunk))
                    if out:
                        await response.write(out)
                if not keep_handle and (rest := _without_handle(parser.close())):
                    await response.write(rest)
            await response.write_eof()
            ended = await read_to_end(upstream)
        except (aiohttp.ClientError, TimeoutError, ConnectionResetError) as exc:
            outcome = "stream_failed"
            log.warning("decode stream failed: %r", exc)
            if account is not None and not account.reported:
                await self._report(account, f"decode stream failed: {exc!r}")
            # As the gateway ends a stream that broke midway: an error event the client can read.
            await end_with_error(response, f"decode stream failed: {exc!r}")
        except asyncio.CancelledError:
            outcome = CLIENT_GONE
            if account is not None and not account.reported:
                # Off the cancelled task: the picker still learns that the turn ended unfinished.
                self._background(self._report(account, "the client disconnected"))
            raise
        finally:
            self.metrics.legs.labels("decode", outcome).observe(time.perf_counter() - start)
            # Closing an unfinished upstream aborts D's request, which frees its blocks; a finished
            # one read to its end keeps its connection for the next leg.
            if ended:
                upstream.release()
            else:
                upstream.close()
        return response

    async def _relay_reported(
        self, response: web.StreamResponse, upstream: aiohttp.ClientResponse, account: AnswerAccount
    ) -> None:
        """D's stream to the client, its end held until the picker has the report."""
        async for chunk in upstream.content.iter_any():
            if out := account.feed(chunk):
                await response.write(out)
            if account.finished:
                break
        if out := account.close():
            await response.write(out)
        await self._report(account, "" if account.finished else "the decode stream ended before [DONE]")
        if account.held:
            await response.write(bytes(account.held))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _without_handle(events: list[sse.SseEvent]) -> bytes:
    out = bytearray()
    for event in events:
        payload = event.json() if _HANDLE_KEY in event.raw else None
        if payload is not None and "kv_transfer_params" in payload:
            del payload["kv_transfer_params"]
            out += sse.encode(payload)
        else:
            out += event.raw
    return bytes(out)


def _report_headers(report: PrefillReport | None) -> dict[str, str]:
    return {PREFILL_REPORT_HEADER: report.encode()} if report is not None else {}


def _decode_failed(request: web.Request, exc: LegFailed, report: PrefillReport | None) -> web.Response:
    """D's leg failed before anything was sent. An unreachable D on the turn's first attempt is
    answered 503 with `x-kvplane-retry-elsewhere`, which Envoy's retry policy sends to another
    decode pod, as the gateway routes such a turn around its D (`failover.after_decode_failure`;
    Envoy counts the attempts in `x-envoy-attempt-count`). Any other failure ends the turn."""
    if failover.after_decode_failure(exc, attempt=_attempt(request)) is failover.DecodeNext.REROUTE:
        message = f"{exc}; another decode engine may serve the turn"
        response = _failed(failover.NO_ENGINE_STATUS, message, b"", report)
        response.headers[RETRY_ELSEWHERE] = exc.outcome
        return response
    return _failed(failover.client_status(exc), str(exc), exc.body, report)


def _attempt(request: web.Request) -> int:
    """The turn's attempt as Envoy counts it, from 1; 1 when Envoy does not say."""
    counted = request.headers.get(ATTEMPT_HEADER, "")
    return max(1, int(counted)) if counted.isdigit() else 1


def _failed(status: int, message: str, body: bytes, report: PrefillReport | None) -> web.Response:
    """An engine's own error answer passed through; anything else described in OpenAI's format."""
    if body:
        response = web.Response(body=body, status=status, content_type="application/json")
    else:
        response = error_response(status, message)
    response.headers.update(_report_headers(report))
    return response


async def _health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})
