"""One turn through kvplane: Route, the P leg, the D leg streamed to the client, then ReportTurn.

- The P leg is retried once without the handle when it fails for a reason
  other than the request itself (5xx, timeout, refused connection): a stale
  or unreadable handle must never fail a user's turn.
- While routing is unreachable, the configured fallback engines serve the
  turn as a recompute, taken in turn and skipping any whose leg just failed
  (`fallback.py`); a retry never returns to the engine that failed it.
- D's events are forwarded one by one as they arrive. The chunk with
  `finish_reason` carries D's new handle: it is taken out of what the client
  sees and reported after the client's stream has ended, so reporting never
  delays the answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvplane.services.client import Endpoint, RouteResult, RoutingClient, RoutingUnavailable, leg_url
from kvplane.services.client.vllm_requests import decode_body, prefill_body
from kvplane.services.common.handles import KEY_CONVERSATION, KEY_TENANT, fresh_prefill_params
from kvplane.services.common.settings import GatewaySection
from kvplane.services.gateway import sse
from kvplane.services.gateway.decode_events import DecodeEvents, DigestingEngines
from kvplane.services.gateway.fallback import FallbackEngines
from kvplane.services.gateway.identity import Identity
from kvplane.services.gateway.legs import LegFailed, LegTimeouts, open_stream, post_json
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected, error_body
from kvplane.services.gateway.progress import (
    PromptSources,
    TurnProgress,
    TurnRequest,
    absorb,
    prompt_sources,
)
from kvplane.services.gateway.prompts import RoutedPrompt, TokenizeEndpoints, UnknownModel, routed_prompt
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.request_body import BodyLimits, check_context, max_output_tokens
from kvplane.services.gateway.suspects import SuspectEngines
from kvplane.v1 import routing_pb2

log = logging.getLogger(__name__)

# Decisions the gateway adds to routing's own ("pull", "recompute_no_handle", ...).
FALLBACK = "fallback"
RETRY_NO_HANDLE = "retry_no_handle"

# The outcome label of a leg whose client went away.
CLIENT_GONE = "client_gone"

DECISION_HEADER = "x-kvplane-decision"
ROUTE_HEADER = "x-kvplane-route-id"
CONVERSATION_HEADER = "x-kvplane-conversation"

_PROPAGATOR = TraceContextTextMapPropagator()


class ClientGone(Exception):
    """The client closed its connection while its answer was being written."""


class DecodeUnreachable(Exception):
    """The decode engine could not be reached; nothing has been sent to the client yet."""

    def __init__(
        self, message: str, route: RouteResult, prefill_params: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.route = route
        # What P returned for this attempt: its blocks wait for a D that will not read them.
        self.prefill_params = prefill_params


class TurnFailed(Exception):
    """The turn cannot be served; `status` and `body` are what the client gets."""

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # An engine's own error body, passed through when it rejected the request.
        self.body = body


class TurnRunner:
    """Runs turns; one per gateway, shared by all requests."""

    def __init__(
        self,
        settings: GatewaySection,
        routing: RoutingClient,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
    ) -> None:
        self.settings = settings
        self.routing = routing
        self.session = session
        self.metrics = metrics
        self.tracer = tracer
        self.tokenizers = TokenizeEndpoints()
        self.reporter = TurnReporter(settings, routing, metrics)
        self.digesting = DigestingEngines()
        self.fallback = FallbackEngines(
            settings.fallback_prefill_url,
            settings.fallback_decode_url,
            SuspectEngines(settings.fallback_suspect_s),
        )

    async def drain_reports(self, timeout_s: float) -> None:
        """Waits for reports still in flight (at shutdown)."""
        await self.reporter.drain(timeout_s)

    # -- the turn -------------------------------------------------------------------

    async def serve(self, request: web.Request, turn: TurnRequest) -> web.StreamResponse:
        # The headers themselves, not a dict copy: their lookups ignore case, as HTTP does.
        parent = _PROPAGATOR.extract(request.headers)
        with self.tracer.start_as_current_span(
            "gateway.turn", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute("kvplane.conversation", turn.identity.conversation)
            s = self.settings
            try:
                prompt = await routed_prompt(
                    self.session, turn.body, turn.chat, s.tokenize_url, s.prefill_timeout_s, self.tokenizers
                )
            except UnknownModel as exc:
                raise TurnFailed(404, str(exc), exc.body) from None
            if prompt.token_ids:
                # A tokenized prompt's length is known now: refuse what D would refuse, before Route
                # checks a handle out and P holds the prompt's KV.
                try:
                    limits = BodyLimits(max_model_len=s.max_model_len)
                    check_context(len(prompt.token_ids), turn.body, turn.chat, limits)
                except RequestRejected as exc:
                    body = json.dumps(error_body(exc.status, exc.message, param=exc.param)).encode()
                    raise TurnFailed(exc.status, exc.message, body) from None
            route = await self._route(turn, prompt)
            try:
                return await self._attempt(request, turn, prompt, route, last_try=False)
            except DecodeUnreachable as exc:
                dead_decode = exc.route.decode
                self.fallback.suspects.mark(dead_decode.http_url, time.monotonic())
                # D went away before anything reached the client (a dead engine whose registration
                # has not lapsed yet): route again, which may choose another, and run the turn once more.
                log.warning("decode leg unreachable (%s): routing the turn again", exc)
                self.metrics.retries.labels("decode_unreachable").inc()
                if exc.route.route_id:
                    failed = TurnProgress(
                        exc.route.decision, error=str(exc), prefill_params=exc.prefill_params
                    )
                    self.reporter.report_later(turn, exc.route, failed, success=False)
            # Never the decode engine that just failed: routing also marks it suspect for every
            # replica, and the fallback engines, if routing is down, are chosen without it.
            route = await self._route(
                turn, prompt, failed=(dead_decode.node_id,), avoid_urls=(dead_decode.http_url,)
            )
            return await self._attempt(request, turn, prompt, route, last_try=True)

    async def _attempt(
        self,
        request: web.Request,
        turn: TurnRequest,
        prompt: RoutedPrompt,
        route: RouteResult,
        *,
        last_try: bool,
    ) -> web.StreamResponse:
        progress = TurnProgress(route.decision, list(prompt.token_ids) or None)
        # The turn's span, as users look for it: the decision, where the prompt's KV came from, TTFT.
        turn_span = trace.get_current_span()
        try:
            prefill_answer, route = await self._prefill(turn, prompt, route, progress)
            if turn.stream:
                return await self._decode_streaming(request, turn, route, prefill_answer, progress, last_try)
            return await self._decode_whole(turn, route, prefill_answer, progress, last_try)
        finally:
            turn_span.set_attribute("kvplane.decision", progress.decision)
            turn_span.set_attribute("kvplane.route_id", route.route_id)
            if progress.sources is not None:
                turn_span.set_attributes(_token_attributes(progress.sources))
            if progress.ttft_s is not None:
                turn_span.set_attribute("kvplane.ttft_s", progress.ttft_s)

    # -- route ------------------------------------------------------------------------

    async def _route(
        self,
        turn: TurnRequest,
        prompt: RoutedPrompt,
        failed: tuple[str, ...] = (),
        avoid_urls: tuple[str, ...] = (),
    ) -> RouteResult:
        start = time.perf_counter()
        try:
            route = await self._call_route(turn, prompt, failed)
        except RoutingUnavailable as exc:
            self.metrics.legs.labels("route", "unavailable").observe(time.perf_counter() - start)
            return self._fallback(turn, str(exc), avoid_urls)
        except grpc.aio.AioRpcError as exc:
            self.metrics.legs.labels("route", exc.code().name.lower()).observe(time.perf_counter() - start)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise TurnFailed(400, f"invalid request: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                # No engine serves the request's model: this request's error alone.
                raise TurnFailed(404, exc.details() or "model not found") from None
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                # The gateway's own routing credentials are wrong: every turn is affected.
                log.warning(
                    "routing refused the gateway's credentials: %s: %s", exc.code().name, exc.details()
                )
            # Any other refusal (deadline, auth misconfiguration, internal) must not fail the turn.
            return self._fallback(turn, f"{exc.code().name}: {exc.details()}", avoid_urls)
        self.metrics.legs.labels("route", "ok").observe(time.perf_counter() - start)
        return route

    async def _call_route(
        self, turn: TurnRequest, prompt: RoutedPrompt, failed: tuple[str, ...] = ()
    ) -> RouteResult:
        awaited_id, awaited_tokens = self.reporter.awaited(turn)
        return await self.routing.route(
            turn.identity.conversation,
            turn.model,
            prompt_tokens=prompt.tokens,
            prompt_token_ids=prompt.token_ids,
            request_id=uuid.uuid4().hex,
            tenant=turn.identity.tenant,
            failed_node_ids=failed,
            awaited_handle_id=awaited_id,
            awaited_handle_tokens=awaited_tokens,
            max_output_tokens=max_output_tokens(turn.body, turn.chat),
        )

    def _fallback(self, turn: TurnRequest, why: str, avoid_urls: tuple[str, ...] = ()) -> RouteResult:
        if not self.fallback.configured:
            raise TurnFailed(503, f"routing is unavailable and no fallback engines are configured ({why})")
        now = time.monotonic()
        prefill = self.fallback.prefill(now, avoid_urls)
        decode = self.fallback.decode(now, avoid_urls)
        log.warning(
            "routing unavailable (%s): serving from fallback engines P %s (%s) and D %s (%s)",
            why,
            prefill.url,
            prefill.reason,
            decode.url,
            decode.reason,
        )
        self.metrics.retries.labels("routing_unavailable").inc()
        return RouteResult(
            route_id="",
            decision=FALLBACK,
            reason=f"routing unavailable: {why}",
            prefill=Endpoint("fallback-prefill", prefill.url, ""),
            decode=Endpoint("fallback-decode", decode.url, ""),
            prefill_params=_fresh_params(turn.identity),
            expected_reused_tokens=0,
            response=routing_pb2.RouteResponse(),
        )

    # -- the P leg -----------------------------------------------------------------------

    async def _prefill(
        self, turn: TurnRequest, prompt: RoutedPrompt, route: RouteResult, progress: TurnProgress
    ) -> tuple[dict[str, Any], RouteResult]:
        try:
            return await self._prefill_once(turn, route, progress), route
        except LegFailed as exc:
            if not exc.retryable:
                # P rejected the request itself: the same body would be rejected again.
                self._finish(turn, route, progress, success=False, error=str(exc))
                raise TurnFailed(exc.status, str(exc), exc.body) from None
            failure = exc
        log.warning("prefill leg failed (%s): retrying once without the handle", failure)
        self.metrics.retries.labels(f"prefill_{failure.outcome}").inc()
        if route.route_id:
            # The checked-out handle is spent either way; routing learns the route failed.
            self.reporter.report_later(
                turn, route, TurnProgress(route.decision, error=str(failure)), success=False
            )
        retry = route
        if failure.unreachable or failure.outcome == "timeout":
            # P itself may be down or stuck: never the same prefill engine again. Routing is asked
            # again (it also marks P suspect for every replica); without routing, another fallback P.
            dead = route.prefill.http_url
            self.fallback.suspects.mark(dead, time.monotonic())
            try:
                if route.decision == FALLBACK:
                    raise RoutingUnavailable("the turn was already served without routing")
                retry = await self._call_route(turn, prompt, (route.prefill.node_id,))
            except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
                if self.fallback.configured:
                    other = self.fallback.prefill(time.monotonic(), (dead,))
                    log.warning("prefill retry on fallback engine %s (%s): %s", other.url, other.reason, exc)
                    retry = dataclasses.replace(route, prefill=Endpoint("fallback-prefill", other.url, ""))
        retry = dataclasses.replace(
            retry, route_id="", decision=RETRY_NO_HANDLE, prefill_params=_fresh_params(turn.identity)
        )
        progress.decision = RETRY_NO_HANDLE
        try:
            return await self._prefill_once(turn, retry, progress), retry
        except LegFailed as exc:
            self.metrics.turns.labels(RETRY_NO_HANDLE, "failed").inc()
            status = exc.status if not exc.retryable else 502
            raise TurnFailed(status, f"prefill failed twice: {failure}; then {exc}", exc.body) from None

    async def _prefill_once(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress
    ) -> dict[str, Any]:
        body = prefill_body(turn.body, route)
        body["return_token_ids"] = True
        start = time.perf_counter()
        outcome = "ok"
        with self.tracer.start_as_current_span("gateway.prefill", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.prefill.node_id)
            try:
                answer = await post_json(
                    self.session,
                    "prefill",
                    leg_url(route.prefill.http_url, _path(turn)),
                    body,
                    _trace_headers(),
                    LegTimeouts(self.settings.connect_timeout_s, self.settings.prefill_timeout_s),
                )
            except LegFailed as exc:
                outcome = exc.outcome
                raise
            except asyncio.CancelledError:
                outcome = CLIENT_GONE
                raise
            finally:
                self.metrics.legs.labels("prefill", outcome).observe(time.perf_counter() - start)
            # vLLM's usage counts pulled tokens and P's own cache hits alike as cached; kvplane's
            # connector (and the sim-engine) report the pull itself, so that each is counted as what it is.
            progress.sources = prompt_sources(answer)
            params = answer.get("kv_transfer_params")
            progress.prefill_params = params if isinstance(params, dict) else None
            span.set_attributes(_token_attributes(progress.sources))
        progress.prefill_s = time.perf_counter() - start
        for source, tokens in progress.sources.counts().items():
            self.metrics.prompt_tokens.labels(source).inc(tokens)
        return answer

    # -- the D leg -------------------------------------------------------------------------

    def _decode_request(
        self, turn: TurnRequest, route: RouteResult, prefill_answer: Mapping[str, Any], asked_ids: bool
    ) -> dict[str, Any]:
        if isinstance(prefill_answer.get("kv_transfer_params"), Mapping):
            body = decode_body(turn.body, route, prefill_answer)
        else:
            # P is not running the connector: D computes the prompt itself, which still answers the user.
            log.warning("prefill engine %s returned no kv_transfer_params", route.prefill.node_id)
            body = dict(turn.body)
        if asked_ids:
            body["return_token_ids"] = True
        return body

    def _ask_for_token_ids(self, turn: TurnRequest, route: RouteResult, progress: TurnProgress) -> bool:
        return self.digesting.ask_for_token_ids(
            route.decode, client_asked=turn.client_token_ids, prompt_known=progress.prompt_ids is not None
        )

    def _headers(self, route: RouteResult, progress: TurnProgress, turn: TurnRequest) -> dict[str, str]:
        return {
            DECISION_HEADER: progress.decision,
            ROUTE_HEADER: route.route_id,
            CONVERSATION_HEADER: turn.identity.conversation,
        }

    async def _decode_whole(
        self,
        turn: TurnRequest,
        route: RouteResult,
        prefill_answer: Mapping[str, Any],
        progress: TurnProgress,
        last_try: bool,
    ) -> web.StreamResponse:
        start = time.perf_counter()
        outcome = "ok"
        with self.tracer.start_as_current_span("gateway.decode", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.decode.node_id)
            try:
                answer = await post_json(
                    self.session,
                    "decode",
                    leg_url(route.decode.http_url, _path(turn)),
                    self._decode_request(
                        turn, route, prefill_answer, self._ask_for_token_ids(turn, route, progress)
                    ),
                    _trace_headers(),
                    LegTimeouts(self.settings.connect_timeout_s, self.settings.decode_timeout_s),
                )
            except LegFailed as exc:
                outcome = exc.outcome
                if exc.unreachable and not last_try:
                    raise DecodeUnreachable(str(exc), route, progress.prefill_params) from exc
                self._finish(turn, route, progress, success=False, error=str(exc))
                raise TurnFailed(exc.status if not exc.retryable else 502, str(exc), exc.body) from None
            except asyncio.CancelledError:
                outcome = CLIENT_GONE
                self._finish(turn, route, progress, success=False, error="the client disconnected")
                raise
            finally:
                self.metrics.legs.labels("decode", outcome).observe(time.perf_counter() - start)
        absorb(answer, progress, turn.client_token_ids)
        self.reporter.announce(turn, progress.decode_params)
        self.digesting.learn(route.decode, progress.decode_params)
        progress.ttft_s = time.perf_counter() - turn.arrival
        response = web.json_response(answer, headers=self._headers(route, progress, turn))
        self._finish(turn, route, progress, success=True)
        return response

    async def _decode_streaming(
        self,
        request: web.Request,
        turn: TurnRequest,
        route: RouteResult,
        prefill_answer: Mapping[str, Any],
        progress: TurnProgress,
        last_try: bool,
    ) -> web.StreamResponse:
        start = time.perf_counter()
        s = self.settings
        timeouts = LegTimeouts(s.connect_timeout_s, s.decode_timeout_s, s.decode_idle_timeout_s)
        asked_ids = self._ask_for_token_ids(turn, route, progress)
        stream = DecodeEvents(
            progress,
            asked_ids=asked_ids,
            keep_ids=turn.client_token_ids,
            collect_ids=not self.digesting.digests(route.decode),
        )
        with self.tracer.start_as_current_span("gateway.decode", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.decode.node_id)
            try:
                upstream = await open_stream(
                    self.session,
                    "decode",
                    leg_url(route.decode.http_url, _path(turn)),
                    self._decode_request(turn, route, prefill_answer, asked_ids),
                    _trace_headers(),
                    timeouts,
                )
            except LegFailed as exc:
                self.metrics.legs.labels("decode", exc.outcome).observe(time.perf_counter() - start)
                if exc.unreachable and not last_try:
                    raise DecodeUnreachable(str(exc), route, progress.prefill_params) from exc
                self._finish(turn, route, progress, success=False, error=str(exc))
                raise TurnFailed(exc.status if not exc.retryable else 502, str(exc), exc.body) from None
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **self._headers(route, progress, turn),
                }
            )
            outcome, finished = "ok", False
            announced: dict[str, Any] | None = None
            try:
                await _to_client(response.prepare(request))
                async for event in sse.events(upstream.content.iter_any()):
                    raw, token = stream.forward(event)
                    if progress.decode_params is not announced:
                        # D's handle, before the client sees the chunk: its next turn may come at once.
                        announced = progress.decode_params
                        self.reporter.announce(turn, announced)
                    # One write per event: aiohttp sends it at once, so tokens reach the client as made.
                    await _to_client(response.write(raw))
                    if progress.ttft_s is None and token:
                        progress.ttft_s = time.perf_counter() - turn.arrival
                    if event.done:
                        finished = True
                        break
                await _to_client(response.write_eof())
                self.digesting.learn(route.decode, progress.decode_params)
            except ClientGone:
                outcome, progress.error = CLIENT_GONE, "the client disconnected"
            except asyncio.CancelledError:
                outcome, progress.error = CLIENT_GONE, "the client disconnected"
                self._finish(turn, route, progress, success=False, error=progress.error)
                raise
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome, progress.error = "stream_failed", f"decode stream failed: {exc!r}"
                await _end_with_error(response, progress.error)
            finally:
                # Closing an unfinished upstream aborts D's request, which frees its blocks.
                if finished:
                    upstream.release()
                else:
                    upstream.close()
                self.metrics.legs.labels("decode", outcome).observe(time.perf_counter() - start)
        self._finish(turn, route, progress, success=finished and not progress.error, error=progress.error)
        return response

    # -- the report ----------------------------------------------------------------------------

    def _finish(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, *, success: bool, error: str = ""
    ) -> None:
        outcome = "ok" if success else "failed"
        self.metrics.turns.labels(progress.decision, outcome).inc()
        if success and progress.ttft_s is not None:
            self.metrics.ttft.labels(progress.decision).observe(progress.ttft_s)
        if error and not progress.error:
            progress.error = error
        self.reporter.report_later(turn, route, progress, success=success)


def _path(turn: TurnRequest) -> str:
    return "/v1/chat/completions" if turn.chat else "/v1/completions"


def _fresh_params(identity: Identity) -> dict[str, Any]:
    """Turn-1 P params with kvplane's keys, so that D's connector still publishes its handle."""
    params = fresh_prefill_params()
    params[KEY_TENANT] = identity.tenant
    params[KEY_CONVERSATION] = identity.conversation
    return params


def _token_attributes(sources: PromptSources) -> dict[str, int]:
    """`kvplane.tokens.{prompt,pulled,prefill_cache,computed}` (or `.unattributed`) for a span."""
    return {"kvplane.tokens.prompt": sources.prompt} | {
        f"kvplane.tokens.{source}": tokens for source, tokens in sources.counts().items()
    }


def _trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for an engine leg."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers)
    return headers


async def _to_client(write: Awaitable[Any]) -> None:
    """Awaits a write to the client; a reset means the client left (aiohttp's reset error is also a
    ClientError, which would otherwise read as a failure of the decode leg)."""
    try:
        await write
    except ConnectionResetError as exc:
        raise ClientGone(str(exc)) from exc


async def _end_with_error(response: web.StreamResponse, message: str) -> None:
    """Ends a stream that broke midway with an error event, as vLLM does, if the client is still there."""
    error = {"error": {"message": message, "type": "BadGatewayError", "code": 502}}
    try:
        await response.write(sse.encode(error))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        log.info("could not end the stream: the client is gone")
