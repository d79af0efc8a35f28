"""One turn through kvplane: Route, the P leg, the D leg streamed to the client, then ReportTurn.

Each step has its module: `routing_step.py` (Route, or the fallback engines while routing is
unreachable), `prefill_leg.py`, `decode_leg.py`, and `reports.py` (ReportTurn, off the client's
path). What happens when a step fails is `failover.py`'s rules:

- The P leg is retried once without the handle when it fails for a reason
  other than the request itself (5xx, timeout, refused connection): a stale
  or unreadable handle must never fail a user's turn.
- While routing is unreachable, the configured fallback engines serve the
  turn as a recompute, taken in turn and skipping any whose leg just failed
  (`fallback.py`); a retry never returns to the engine that failed it.
- A D that cannot be reached before anything reached the client is routed
  around, once.

A turn routed `prefill_on_decode` has no P leg: D, which holds the conversation's KV, prefills
it itself (`decode_only_body`), so a failure there is a D leg's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvplane.services.client import RouteResult, RoutingClient
from kvplane.services.gateway import failover
from kvplane.services.gateway.decode_leg import DecodeLeg
from kvplane.services.gateway.fallback import FallbackEngines
from kvplane.services.gateway.local_tokenizer import LocalTokenizers
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.openai_errors import RequestRejected, error_body
from kvplane.services.gateway.prefill_leg import PrefillLeg
from kvplane.services.gateway.progress import TurnProgress, TurnRequest
from kvplane.services.gateway.prompts import RoutedPrompt, TokenizeEndpoints, UnknownModel, routed_prompt
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.request_body import BodyLimits, check_context
from kvplane.services.gateway.routing_step import RoutingStep
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.suspects import SuspectEngines
from kvplane.services.gateway.turn_errors import DecodeUnreachable, TurnFailed

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()


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
        self.session = session
        self.metrics = metrics
        self.tracer = tracer
        self.tokenizers = TokenizeEndpoints()
        # Loaded here, so that a tokenizer the gateway cannot read stops it at start.
        self.local_tokenizers = LocalTokenizers(settings.tokenizers)
        self.reporter = TurnReporter(settings, routing, metrics)
        self.fallback = FallbackEngines(
            settings.fallback_prefill_url,
            settings.fallback_decode_url,
            SuspectEngines(settings.fallback_suspect_s),
        )
        self.routing = RoutingStep(
            routing, self.fallback, self.reporter, metrics, prefill_on_decode=settings.prefill_on_decode
        )
        self.prefill = PrefillLeg(settings, session, self.routing, self.reporter, metrics, tracer)
        self.decode = DecodeLeg(settings, session, self.reporter, metrics, tracer)

    async def drain_reports(self, timeout_s: float) -> None:
        """Waits for reports still in flight (at shutdown)."""
        await self.reporter.drain(timeout_s)

    async def serve(self, request: web.Request, turn: TurnRequest) -> web.StreamResponse:
        # The headers themselves, not a dict copy: their lookups ignore case, as HTTP does.
        parent = _PROPAGATOR.extract(request.headers)
        with self.tracer.start_as_current_span(
            "gateway.turn", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute("kvplane.conversation", turn.identity.conversation)
            prompt = await self.prompt(turn)
            route = await self.routing.route(turn, prompt)
            try:
                return await self._attempt(request, turn, prompt, route, attempt=1)
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
            route = await self.routing.route(
                turn, prompt, failed=(dead_decode.node_id,), avoid_urls=(dead_decode.http_url,)
            )
            return await self._attempt(request, turn, prompt, route, attempt=failover.MAX_ATTEMPTS)

    async def prompt(self, turn: TurnRequest) -> RoutedPrompt:
        """The prompt as routing sees it, refused here when D would refuse it."""
        s = self.settings
        try:
            prompt = await routed_prompt(
                self.session,
                turn.body,
                turn.chat,
                s.tokenize_url,
                s.prefill_timeout_s,
                self.tokenizers,
                timed=lambda outcome, seconds: self.metrics.legs.labels("tokenize", outcome).observe(seconds),
                local=self.local_tokenizers,
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
        return prompt

    async def _attempt(
        self,
        request: web.Request,
        turn: TurnRequest,
        prompt: RoutedPrompt,
        route: RouteResult,
        *,
        attempt: int,
    ) -> web.StreamResponse:
        progress = TurnProgress(route.decision, list(prompt.token_ids) or None)
        # The turn's span, as users look for it: the decision, where the prompt's KV came from, TTFT.
        turn_span = trace.get_current_span()
        try:
            if route.on_decode:
                # Routing chose the D that holds the conversation's KV to prefill the turn itself.
                prefill_answer: Mapping[str, Any] = {}
            else:
                prefill_answer, route = await self.prefill.run(turn, prompt, route, progress)
            if turn.stream:
                return await self.decode.streaming(request, turn, route, prefill_answer, progress, attempt)
            return await self.decode.whole(turn, route, prefill_answer, progress, attempt)
        finally:
            turn_span.set_attribute("kvplane.decision", progress.decision)
            turn_span.set_attribute("kvplane.route_id", route.route_id)
            if progress.sources is not None:
                turn_span.set_attributes(progress.sources.span_attributes())
            if progress.ttft_s is not None:
                turn_span.set_attribute("kvplane.ttft_s", progress.ttft_s)
