"""A turn's Route: routing's choice of P and D, or the fallback engines while routing cannot choose.

Which refusals fail the turn and which are served from the fallback engines is
`failover.after_route_refusal`'s rule; this module makes the calls and counts them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import grpc

from kvplane.services.client import Endpoint, RouteResult, RoutingClient, RoutingUnavailable
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_TENANT, fresh_prefill_params
from kvplane.services.gateway import cache_salt, failover
from kvplane.services.gateway.fallback import FallbackEngines
from kvplane.services.gateway.identity import Identity
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnRequest
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.request_body import max_output_tokens
from kvplane.services.gateway.turn_errors import TurnFailed
from kvplane.v1 import routing_pb2

log = logging.getLogger(__name__)


class RoutingStep:
    """Asks routing where a turn runs; one per gateway, used from its event loop only."""

    def __init__(
        self,
        routing: RoutingClient,
        fallback: FallbackEngines,
        reporter: TurnReporter,
        metrics: GatewayMetrics,
        *,
        prefill_on_decode: bool = False,
    ) -> None:
        self.routing = routing
        self.fallback = fallback
        self.reporter = reporter
        self.metrics = metrics
        # Whether routing may send a turn to its D alone (GatewaySection.prefill_on_decode).
        self.prefill_on_decode = prefill_on_decode

    async def route(
        self,
        turn: TurnRequest,
        prompt: RoutedPrompt,
        failed: tuple[str, ...] = (),
        avoid_urls: tuple[str, ...] = (),
    ) -> RouteResult:
        """Routing's route for the turn, never through the nodes `failed` names; the fallback
        engines' (never those at `avoid_urls`) when routing cannot place it."""
        start = time.perf_counter()
        try:
            route = await self.ask(turn, prompt, failed)
        except RoutingUnavailable as exc:
            self.metrics.legs.labels("route", "unavailable").observe(time.perf_counter() - start)
            return self.fallback_route(turn, str(exc), avoid_urls)
        except grpc.aio.AioRpcError as exc:
            self.metrics.legs.labels("route", exc.code().name.lower()).observe(time.perf_counter() - start)
            refusal = failover.after_route_refusal(exc.code().name)
            if refusal is failover.RouteRefusal.INVALID_REQUEST:
                raise TurnFailed(400, f"invalid request: {exc.details()}") from None
            if refusal is failover.RouteRefusal.UNKNOWN_MODEL:
                raise TurnFailed(404, exc.details() or "model not found") from None
            if refusal is failover.RouteRefusal.CREDENTIALS_REFUSED:
                log.warning(
                    "routing refused the gateway's credentials: %s: %s", exc.code().name, exc.details()
                )
            return self.fallback_route(turn, f"{exc.code().name}: {exc.details()}", avoid_urls)
        self.metrics.legs.labels("route", "ok").observe(time.perf_counter() - start)
        return route

    async def ask(
        self,
        turn: TurnRequest,
        prompt: RoutedPrompt,
        failed: tuple[str, ...] = (),
        *,
        on_decode_ok: bool = True,
    ) -> RouteResult:
        """One Route call; routing's errors are the caller's to handle. `on_decode_ok`: False for a
        route that must have a P leg (a P leg's retry)."""
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
            cache_salt=_salt(turn.body),
            prefill_on_decode_ok=self.prefill_on_decode and on_decode_ok,
        )

    def fallback_route(self, turn: TurnRequest, why: str, avoid_urls: tuple[str, ...] = ()) -> RouteResult:
        """A recompute on the next fallback P and D; 503 when none are configured."""
        if not self.fallback.configured:
            # The why names internal addresses: it goes to the log, not to the client.
            log.warning("routing unavailable (%s) and no fallback engines are configured", why)
            raise TurnFailed(
                failover.NO_ENGINE_STATUS,
                "routing is unavailable and no fallback engines are configured; try again shortly",
            )
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
            decision=failover.FALLBACK,
            reason=f"routing unavailable: {why}",
            prefill=Endpoint("fallback-prefill", prefill.url, ""),
            decode=Endpoint("fallback-decode", decode.url, ""),
            prefill_params=fresh_params(turn.identity),
            expected_reused_tokens=0,
            response=routing_pb2.RouteResponse(),
        )


def fresh_params(identity: Identity) -> dict[str, Any]:
    """Turn-1 P params with kvplane's keys, so that D's connector still publishes its handle."""
    params = fresh_prefill_params()
    params[KEY_TENANT] = identity.tenant
    params[KEY_CONVERSATION] = identity.conversation
    return params


def _salt(body: Mapping[str, Any]) -> str:
    """The cache_salt the gateway set on the turn's engine requests ("" when isolation is off)."""
    salt = body.get(cache_salt.BODY_KEY)
    return salt if isinstance(salt, str) else ""
