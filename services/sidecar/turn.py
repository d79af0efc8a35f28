"""One turn in the sidecar: the P leg the signed route names, then the local D leg, streamed through.

The calls are the gateway's (`legs.post_json`, `legs.open_stream`, `vllm_requests`), with its
deadlines. A P leg that fails: a request P rejected (4xx) fails with P's answer
(`failover.prefill_retry` says GIVE_UP); any other failure leaves D to compute the prompt itself
(decision `retry_no_handle`), which still answers the user: the sidecar has no routing to ask for
another P, and D, beside it, is always there. A route `prefill_on_decode` has no P leg: D, which
holds the conversation's KV, gets the client's request with the route's params (`on_decode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry import trace

from kvplane.services.client import leg_url
from kvplane.services.client.vllm_requests import decode_body, decode_only_body, prefill_body
from kvplane.services.gateway import failover
from kvplane.services.gateway.failover import PrefillRetry
from kvplane.services.gateway.legs import (
    LegFailed,
    LegTimeouts,
    leg_path,
    open_stream,
    post_json,
    trace_headers,
)
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.turn_errors import CLIENT_GONE, TurnFailed
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.signed_route import SignedRoute

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    body: dict[str, Any]
    # What the P leg did; None when there was none.
    report: PrefillReport | None


class SidecarLegs:
    """Runs a turn's legs; one per sidecar, used from its event loop only."""

    def __init__(
        self,
        limits: GatewaySection,
        decode_url: str,
        session: aiohttp.ClientSession,
        tracer: trace.Tracer,
        metrics: GatewayMetrics,
    ) -> None:
        self.limits = limits
        self.decode_url = decode_url
        self.session = session
        self.tracer = tracer
        self.metrics = metrics

    @contextlib.contextmanager
    def timed(self, leg: str) -> Iterator[None]:
        """Observes the leg's time in `kvplane_gateway_leg_seconds`, by outcome, as the gateway does."""
        start, outcome = time.perf_counter(), "ok"
        try:
            yield
        except LegFailed as exc:
            outcome = exc.outcome
            raise
        except asyncio.CancelledError:
            outcome = CLIENT_GONE
            raise
        finally:
            self.metrics.legs.labels(leg, outcome).observe(time.perf_counter() - start)

    async def prefill(self, signed: SignedRoute, body: Mapping[str, Any], chat: bool) -> DecodeRequest:
        """Runs the P leg and returns D's request; raises TurnFailed when P rejected the request."""
        route = signed.route
        request = prefill_body(body, route)
        # Nothing reads token ids from P's answer (D's carry the client's): as the gateway's P leg,
        # not asking spares P and the sidecar a prompt's worth of ids in JSON each turn.
        request.pop("return_token_ids", None)
        start = time.perf_counter()
        with self.tracer.start_as_current_span("sidecar.prefill", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.prefill.node_id)
            try:
                with self.timed("prefill"):
                    answer = await post_json(
                        self.session,
                        "prefill",
                        leg_url(route.prefill.http_url, leg_path(chat)),
                        request,
                        trace_headers(),
                        LegTimeouts(self.limits.connect_timeout_s, self.limits.prefill_timeout_s),
                    )
            except LegFailed as exc:
                if failover.prefill_retry(exc, routed=True) is PrefillRetry.GIVE_UP:
                    raise TurnFailed(exc.status, str(exc), exc.body) from None
                log.warning("prefill leg failed (%s): the decode engine computes the prompt itself", exc)
                spent = time.perf_counter() - start
                failed = PrefillReport(None, None, spent, failover.RETRY_NO_HANDLE, str(exc))
                return DecodeRequest(self.alone(body, signed), failed)
        report = PrefillReport.of_answer(answer, time.perf_counter() - start)
        if report.params is None:
            # P is not running the connector: D computes the prompt itself.
            log.warning("prefill engine %s returned no kv_transfer_params", route.prefill.node_id)
            return DecodeRequest(self.alone(body, signed), report)
        decode = decode_body(body, route, answer)
        if signed.return_token_ids:
            decode["return_token_ids"] = True
        return DecodeRequest(decode, report)

    def alone(self, body: Mapping[str, Any], signed: SignedRoute | None) -> dict[str, Any]:
        """D's request when D serves the turn alone: no `kv_transfer_params` at all."""
        request = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if signed is not None and signed.return_token_ids:
            request["return_token_ids"] = True
        return request

    def on_decode(self, body: Mapping[str, Any], signed: SignedRoute) -> dict[str, Any]:
        """D's request when the signed route says D prefills the turn (`prefill_on_decode`): the
        route's params, which name the conversation's handle and no remote blocks."""
        request = decode_only_body(body, signed.route)
        if signed.return_token_ids:
            request["return_token_ids"] = True
        return request

    async def decode_whole(self, body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
        """D's whole answer; raises LegFailed."""
        with (
            self.tracer.start_as_current_span("sidecar.decode", kind=trace.SpanKind.CLIENT),
            self.timed("decode"),
        ):
            return await post_json(
                self.session,
                "decode",
                leg_url(self.decode_url, leg_path(chat)),
                body,
                trace_headers(),
                LegTimeouts(self.limits.connect_timeout_s, self.limits.decode_timeout_s),
            )

    async def decode_stream(self, body: Mapping[str, Any], chat: bool) -> aiohttp.ClientResponse:
        """D's open stream; the caller reads and releases it (its time is the caller's to observe).
        Raises LegFailed."""
        s = self.limits
        with self.tracer.start_as_current_span("sidecar.decode", kind=trace.SpanKind.CLIENT):
            return await open_stream(
                self.session,
                "decode",
                leg_url(self.decode_url, leg_path(chat)),
                body,
                trace_headers(),
                LegTimeouts(s.connect_timeout_s, s.decode_timeout_s, s.decode_idle_timeout_s),
            )
