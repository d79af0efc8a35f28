"""A turn's D leg: D reads the prompt's KV from P and generates, streamed or whole, to the client.

D's events are forwarded as they arrive, those read together in one write; a read holding nothing
the turn needs (tokens past the first) goes on as D wrote it, not split into events. The chunk
with `finish_reason` carries D's new handle: it is announced before the client sees the chunk
(the conversation's next turn may come at once) and reported after the client's stream has ended,
so reporting never delays the answer. A D that cannot be reached is routed around
(`failover.after_decode_failure`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, NoReturn

import aiohttp
from aiohttp import web
from opentelemetry import trace

from kvplane.services.client import RouteResult, leg_url
from kvplane.services.client.vllm_requests import decode_body, decode_only_body
from kvplane.services.gateway import failover, sse
from kvplane.services.gateway.decode_events import DecodeEvents, DigestingEngines
from kvplane.services.gateway.legs import (
    LegFailed,
    LegTimeouts,
    leg_path,
    open_stream,
    post_json,
    read_to_end,
    trace_headers,
)
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnProgress, TurnRequest, absorb
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.turn_errors import CLIENT_GONE, ClientGone, DecodeUnreachable, TurnFailed

log = logging.getLogger(__name__)

DECISION_HEADER = "x-kvplane-decision"
ROUTE_HEADER = "x-kvplane-route-id"
CONVERSATION_HEADER = "x-kvplane-conversation"


class DecodeLeg:
    """Runs D legs and writes their answers to the client; one per gateway, used from its event loop only."""

    def __init__(
        self,
        settings: GatewaySection,
        session: aiohttp.ClientSession,
        reporter: TurnReporter,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
    ) -> None:
        self.settings = settings
        self.session = session
        self.reporter = reporter
        self.metrics = metrics
        self.tracer = tracer
        self.digesting = DigestingEngines()

    def _request(
        self, turn: TurnRequest, route: RouteResult, prefill_answer: Mapping[str, Any], asked_ids: bool
    ) -> dict[str, Any]:
        if route.on_decode:
            # No P leg: D prefills the turn from its own cache (the conversation's handle).
            body = decode_only_body(turn.body, route)
        elif isinstance(prefill_answer.get("kv_transfer_params"), Mapping):
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

    def _fail(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, exc: LegFailed, attempt: int
    ) -> NoReturn:
        """Raises what the turn does about a failed D leg: a reroute while that may help, or its end."""
        if failover.after_decode_failure(exc, attempt=attempt) is failover.DecodeNext.REROUTE:
            raise DecodeUnreachable(str(exc), route, progress.prefill_params) from exc
        self.reporter.finish(turn, route, progress, success=False, error=str(exc))
        raise TurnFailed(failover.client_status(exc), str(exc), exc.body) from None

    async def whole(
        self,
        turn: TurnRequest,
        route: RouteResult,
        prefill_answer: Mapping[str, Any],
        progress: TurnProgress,
        attempt: int,
    ) -> web.StreamResponse:
        """D's answer in one JSON body."""
        start = time.perf_counter()
        outcome = "ok"
        asked_ids = self._ask_for_token_ids(turn, route, progress)
        with self.tracer.start_as_current_span("gateway.decode", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.decode.node_id)
            try:
                answer = await post_json(
                    self.session,
                    "decode",
                    leg_url(route.decode.http_url, leg_path(turn.chat)),
                    self._request(turn, route, prefill_answer, asked_ids),
                    trace_headers(),
                    LegTimeouts(self.settings.connect_timeout_s, self.settings.decode_timeout_s),
                )
            except LegFailed as exc:
                outcome = exc.outcome
                self._fail(turn, route, progress, exc, attempt)
            except asyncio.CancelledError:
                outcome = CLIENT_GONE
                self.reporter.finish(turn, route, progress, success=False, error="the client disconnected")
                raise
            finally:
                self.metrics.legs.labels("decode", outcome).observe(time.perf_counter() - start)
        absorb(answer, progress, turn.client_token_ids)
        self.reporter.announce(turn, progress.decode_params)
        self.digesting.learn(route.decode, progress.decode_params)
        progress.ttft_s = time.perf_counter() - turn.arrival
        response = web.json_response(answer, headers=_headers(route, progress, turn))
        self.reporter.finish(turn, route, progress, success=True)
        return response

    async def streaming(
        self,
        request: web.Request,
        turn: TurnRequest,
        route: RouteResult,
        prefill_answer: Mapping[str, Any],
        progress: TurnProgress,
        attempt: int,
    ) -> web.StreamResponse:
        """D's answer as server-sent events, each forwarded as it arrives."""
        start = time.perf_counter()
        s = self.settings
        timeouts = LegTimeouts(s.connect_timeout_s, s.decode_timeout_s, s.decode_idle_timeout_s)
        asked_ids = self._ask_for_token_ids(turn, route, progress)
        with self.tracer.start_as_current_span("gateway.decode", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("kvplane.node", route.decode.node_id)
            try:
                upstream = await open_stream(
                    self.session,
                    "decode",
                    leg_url(route.decode.http_url, leg_path(turn.chat)),
                    self._request(turn, route, prefill_answer, asked_ids),
                    trace_headers(),
                    timeouts,
                )
            except LegFailed as exc:
                self.metrics.legs.labels("decode", exc.outcome).observe(time.perf_counter() - start)
                self._fail(turn, route, progress, exc, attempt)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **_headers(route, progress, turn),
                }
            )
            stream = DecodeEvents(
                progress,
                asked_ids=asked_ids,
                keep_ids=turn.client_token_ids,
                collect_ids=not self.digesting.digests(route.decode),
            )
            finished = await self._relay(request, response, upstream, stream, turn, route, progress, start)
        success = finished and not progress.error
        self.reporter.finish(turn, route, progress, success=success, error=progress.error)
        return response

    async def _relay(
        self,
        request: web.Request,
        response: web.StreamResponse,
        upstream: aiohttp.ClientResponse,
        stream: DecodeEvents,
        turn: TurnRequest,
        route: RouteResult,
        progress: TurnProgress,
        start: float,
    ) -> bool:
        """Forwards D's events to the client until D's last; True when D finished its answer."""
        outcome, finished, ended = "ok", False, False
        announced: dict[str, Any] | None = None
        try:
            await _to_client(response.prepare(request))
            async for batch in sse.batches(upstream.content.iter_any(), stream.opaque):
                if isinstance(batch, bytes):
                    # Tokens past the first, with nothing the turn needs: sent on as D wrote them.
                    await _to_client(response.write(batch))
                    continue
                out: list[bytes] = []
                token = False
                for event in batch:
                    raw, carries = stream.forward(event)
                    if progress.decode_params is not announced:
                        # D's handle, before the client sees the chunk: its next turn may come at once.
                        announced = progress.decode_params
                        self.reporter.announce(turn, announced)
                    out.append(raw)
                    token = token or carries
                    if event.done:
                        finished = True
                        break
                # One write per read of D's stream: aiohttp sends it at once, so tokens reach the
                # client as made, and those that came together (a gateway behind on its reads)
                # go in one write, not one each.
                await _to_client(response.write(b"".join(out)))
                if progress.ttft_s is None and token:
                    progress.ttft_s = time.perf_counter() - turn.arrival
                if finished:
                    break
            await _to_client(response.write_eof())
            self.digesting.learn(route.decode, progress.decode_params)
            ended = finished and await read_to_end(upstream)
        except ClientGone:
            outcome, progress.error = CLIENT_GONE, "the client disconnected"
        except asyncio.CancelledError:
            outcome, progress.error = CLIENT_GONE, "the client disconnected"
            self.reporter.finish(turn, route, progress, success=False, error=progress.error)
            raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome, progress.error = "stream_failed", f"decode stream failed: {exc!r}"
            await end_with_error(response, progress.error)
        finally:
            # Closing an unfinished upstream aborts D's request, which frees its blocks. A finished
            # one read to its end goes back to the pool for the next leg to D; released before its
            # end, aiohttp would close its connection, and the next leg would open another.
            if ended:
                upstream.release()
            else:
                upstream.close()
            self.metrics.legs.labels("decode", outcome).observe(time.perf_counter() - start)
        return finished


def _headers(route: RouteResult, progress: TurnProgress, turn: TurnRequest) -> dict[str, str]:
    return {
        DECISION_HEADER: progress.decision,
        ROUTE_HEADER: route.route_id,
        CONVERSATION_HEADER: turn.identity.conversation,
    }


async def _to_client(write: Awaitable[Any]) -> None:
    """Awaits a write to the client; a reset means the client left (aiohttp's reset error is also a
    ClientError, which would otherwise read as a failure of the decode leg)."""
    try:
        await write
    except ConnectionResetError as exc:
        raise ClientGone(str(exc)) from exc


async def end_with_error(response: web.StreamResponse, message: str) -> None:
    """Ends a stream that broke midway with an error event, as vLLM does, if the client is still there."""
    error = {"error": {"message": message, "type": "BadGatewayError", "code": 502}}
    try:
        await response.write(sse.encode(error))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        log.info("could not end the stream: the client is gone")
