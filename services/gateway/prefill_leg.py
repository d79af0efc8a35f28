"""A turn's P leg: P computes (or pulls) the prompt's KV and answers with D's transfer params.

When it fails, `failover.prefill_retry` says whether and where it runs once more, without the
handle; this module makes the calls, marks a silent P suspect, and reports the spent route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import aiohttp
import grpc
from opentelemetry import trace

from kvplane.services.client import Endpoint, RouteResult, RoutingUnavailable, leg_url
from kvplane.services.client.vllm_requests import prefill_body
from kvplane.services.gateway import failover
from kvplane.services.gateway.failover import PrefillRetry
from kvplane.services.gateway.legs import LegFailed, LegTimeouts, leg_path, post_json, trace_headers
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnProgress, TurnRequest, prompt_sources
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.routing_step import RoutingStep, fresh_params
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.turn_errors import CLIENT_GONE, TurnFailed

log = logging.getLogger(__name__)


class PrefillLeg:
    """Runs P legs; one per gateway, used from its event loop only."""

    def __init__(
        self,
        settings: GatewaySection,
        session: aiohttp.ClientSession,
        routing: RoutingStep,
        reporter: TurnReporter,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
    ) -> None:
        self.settings = settings
        self.session = session
        self.routing = routing
        self.reporter = reporter
        self.metrics = metrics
        self.tracer = tracer

    async def run(
        self, turn: TurnRequest, prompt: RoutedPrompt, route: RouteResult, progress: TurnProgress
    ) -> tuple[dict[str, Any], RouteResult]:
        """P's answer, and the route it came by (a retry's, when the first try failed)."""
        try:
            return await self.once(turn, route, progress), route
        except LegFailed as exc:
            failure = exc
        action = failover.prefill_retry(failure, routed=route.decision != failover.FALLBACK)
        if action is PrefillRetry.GIVE_UP:
            # P rejected the request itself: the same body would be rejected again.
            self.reporter.finish(turn, route, progress, success=False, error=str(failure))
            raise TurnFailed(failure.status, str(failure), failure.body) from None
        log.warning("prefill leg failed (%s): retrying once without the handle", failure)
        self.metrics.retries.labels(f"prefill_{failure.outcome}").inc()
        if route.route_id:
            # The checked-out handle is spent either way; routing learns the route failed.
            self.reporter.report_later(
                turn, route, TurnProgress(route.decision, error=str(failure)), success=False
            )
        retry = await self._retry_route(turn, prompt, route, action)
        retry = dataclasses.replace(
            retry, route_id="", decision=failover.RETRY_NO_HANDLE, prefill_params=fresh_params(turn.identity)
        )
        progress.decision = failover.RETRY_NO_HANDLE
        try:
            return await self.once(turn, retry, progress), retry
        except LegFailed as exc:
            self.metrics.turns.labels(failover.RETRY_NO_HANDLE, "failed").inc()
            raise TurnFailed(
                failover.client_status(exc), f"prefill failed twice: {failure}; then {exc}", exc.body
            ) from None

    async def _retry_route(
        self, turn: TurnRequest, prompt: RoutedPrompt, route: RouteResult, action: PrefillRetry
    ) -> RouteResult:
        """The route of the retry: the same, or one that avoids a P that may be down."""
        if action is PrefillRetry.SAME_ENGINE:
            return route
        # P itself may be down or stuck: never the same prefill engine again. Routing is asked
        # again (it also marks P suspect for every replica); without routing, another fallback P.
        dead = route.prefill.http_url
        self.routing.fallback.suspects.mark(dead, time.monotonic())
        if action is PrefillRetry.REROUTE:
            try:
                return await self.routing.ask(turn, prompt, (route.prefill.node_id,), on_decode_ok=False)
            except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
                log.warning("prefill retry not routed: %s", exc)
                action = failover.retry_without_routing(fallback_configured=self.routing.fallback.configured)
        if action is PrefillRetry.SAME_ENGINE:
            return route
        other = self.routing.fallback.prefill(time.monotonic(), (dead,))
        log.warning("prefill retry on fallback engine %s (%s)", other.url, other.reason)
        return dataclasses.replace(route, prefill=Endpoint("fallback-prefill", other.url, ""))

    async def once(self, turn: TurnRequest, route: RouteResult, progress: TurnProgress) -> dict[str, Any]:
        """One try of the P leg; what P said about the prompt's sources goes into `progress`."""
        body = prefill_body(turn.body, route)
        # Nothing reads token ids from P's answer (the client sees D's): not asking spares P and the
        # gateway a prompt's worth of ids in JSON each turn, even when the client asked D for them.
        body.pop("return_token_ids", None)
        start = time.perf_counter()
        outcome = "ok"
        with self.tracer.start_as_current_span("gateway.prefill", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.prefill.node_id)
            try:
                answer = await post_json(
                    self.session,
                    "prefill",
                    leg_url(route.prefill.http_url, leg_path(turn.chat)),
                    body,
                    trace_headers(),
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
            span.set_attributes(progress.sources.span_attributes())
        progress.prefill_s = time.perf_counter() - start
        for source, tokens in progress.sources.counts().items():
            self.metrics.prompt_tokens.labels(source).inc(tokens)
        return answer
