"""One request through the picker: an ext_proc stream from its headers to the end of its answer.

The request phase, in order (GIE's endpoint-picker protocol, as llm-d's picker runs it):

1. Headers: only POST to the two completion paths is served (404 otherwise). The tenant comes from
   the operator's source (`epp.tenant_source`): an API key checked as the gateway checks it, or the
   trusted header of the gateway's auth filter. A request without one is refused (401) here, and
   one that declares a body over the gateway's body limit (413): Envoy never sends their bodies.
   The headers are not answered yet: the destination depends on the body.
2. Body chunks are gathered up to the gateway's body limit (`admission.read_limits`; 413 past it).
3. At the body's end: parsed and admitted as the gateway admits it (`turn_request.admit_turn`:
   400 in OpenAI's format for anything malformed, every client `kv_transfer_params` removed, the
   top-level fields the engines do not accept dropped), the tenant's share of prompt tokens held
   (429), the prompt tokenized and routed by the gateway's own steps (`TurnRunner`). The
   destination is D's sidecar, allowed by Envoy's subset hint (else routed again without that D,
   then 503); no engine at all is 503.
4. The headers are answered: destination in `x-gateway-destination-endpoint` and in
   `dynamic_metadata["envoy.lb"]`, P in `x-prefiller-host-port`, the signed route
   (`sidecar/signed_route.py`) in `x-kvplane-route`, each set over any copy the client sent;
   the client's API key removed. Then the admitted body, in chunks.

The response phase is `response_phase.ResponseRelay`'s.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from typing import Any

import orjson
from google.protobuf import json_format
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvplane.services.client import RouteResult
from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.epp import destinations, envoy_messages
from kvplane.services.epp.envoy_messages import Response
from kvplane.services.epp.picker_state import PickerState
from kvplane.services.epp.response_phase import ResponseRelay
from kvplane.services.gateway.admission import parse_json
from kvplane.services.gateway.identity import Unauthorized
from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.progress import TurnProgress, TurnRequest
from kvplane.services.gateway.prompts import RoutedPrompt
from kvplane.services.gateway.turn_errors import TurnFailed
from kvplane.services.gateway.turn_request import admit_turn, record_dropped
from kvplane.services.sidecar.signed_route import PREFILLER_HEADER, ROUTE_HEADER, host_port, sign

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
COMPLETION_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
# What the client's request loses on its way to the sidecar: its credentials, and every header
# the picker alone may set (set over by the picker on a routed request anyway).
_CLIENT_HEADERS_REMOVED = ("authorization", "x-api-key")


class Exchange:
    """One ext_proc stream's state; used from that stream's handler only."""

    def __init__(self, state: PickerState) -> None:
        self.state = state
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.chat = False
        self.tenant = ""
        self.metadata: dict[str, Any] = {}
        self._chunks: list[bytes] = []
        self._size = 0
        self._body_done = False
        self._arrival = 0.0
        self._held = contextlib.ExitStack()
        # The tenant's share of bodies being read, from the headers until the body is parsed.
        self._body_read = contextlib.ExitStack()
        self._span: trace.Span | None = None
        self.relay: ResponseRelay | None = None

    async def handle(self, message: Any) -> list[Response]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._on_headers(message)
        if kind == "request_body":
            return await self._on_body(message.request_body.body, message.request_body.end_of_stream)
        if kind == "request_trailers":
            # Trailers end a body that did not mark its own end.
            out = [] if self._body_done else await self._on_body(b"", True)
            return [*out, envoy_messages.trailers(response=False)]
        if kind == "response_headers":
            headers = envoy_messages.header_map(message.response_headers.headers)
            if self.relay is None:
                return [envoy_messages.response_headers({}, ())]
            return [self.relay.headers(headers)]
        if kind == "response_body":
            body = message.response_body
            if self.relay is None:
                return [envoy_messages.body_chunk(body.body, body.end_of_stream, response=True)]
            return self.relay.body(body.body, body.end_of_stream)
        if kind == "response_trailers":
            if self.relay is not None:
                self.relay.finish()
            return [envoy_messages.trailers(response=True)]
        return []

    def close(self) -> None:
        """The stream has ended: a turn whose answer did not end is reported failed (one whose
        sidecar is answering waits for its report: `answers.py`); its share freed."""
        relay = self.relay
        if relay is not None and not relay.reported and not relay.awaits_report:
            relay.finish("the answer did not reach its end through Envoy")
        if relay is not None and relay.answer_id and self.state.answers is not None and relay.reported:
            self.state.answers.forget(relay.answer_id)
        self._held.close()
        self._body_read.close()
        if self._span is not None:
            self._span.end()

    # -- the request phase ----------------------------------------------------------------

    def _on_headers(self, message: Any) -> list[Response]:
        self._arrival = time.perf_counter()
        self.headers = envoy_messages.header_map(message.request_headers.headers)
        self.metadata = json_format.MessageToDict(message.metadata_context).get("filterMetadata", {})
        path = self.headers.get(":path", "").split("?", 1)[0]
        if self.headers.get(":method") != "POST" or path not in COMPLETION_PATHS:
            served = "the endpoint picker serves POST /v1/completions and /v1/chat/completions"
            return [envoy_messages.immediate(404, served)]
        self.chat = COMPLETION_PATHS[path]
        try:
            self.tenant = self._tenant()
        except Unauthorized as exc:
            return [envoy_messages.immediate(401, str(exc))]
        limits = self.state.read_limits
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            return [
                envoy_messages.immediate(
                    413, f"the body is {declared} bytes; the limit is {limits.max_body_bytes}"
                )
            ]
        if message.request_headers.end_of_stream:
            return [envoy_messages.immediate(400, "the body must be a JSON object")]
        length = int(declared) if declared.isdigit() else None
        try:
            self._body_read.enter_context(
                self.state.body_reads.hold(self.tenant, limits.declared_bytes(length))
            )
        except RequestRejected as exc:
            return [envoy_messages.immediate(exc.status, exc.message)]
        return []

    def _tenant(self) -> str:
        if self.state.epp.tenant_source == "api_key":
            return self.state.keys.tenant(self.headers)
        tenant = self.headers.get(self.state.epp.tenant_header, "")
        try:
            return validation.tenant(tenant, "tenant")
        except InvalidArgument:
            raise Unauthorized(f"no valid tenant in {self.state.epp.tenant_header}") from None

    async def _on_body(self, chunk: bytes, end: bool) -> list[Response]:
        if self._body_done:
            return []
        self._size += len(chunk)
        limit = self.state.read_limits.max_body_bytes
        if self._size > limit:
            self._body_done = True
            self._body_read.close()
            return [envoy_messages.immediate(413, f"the body is over the limit of {limit} bytes")]
        self._chunks.append(chunk)
        if not end:
            return []
        self._body_done = True
        raw = b"".join(self._chunks)
        self._chunks.clear()
        try:
            with self._body_read:
                body = parse_json(raw, self.state.read_limits)
            return await self._pick(body)
        except RequestRejected as exc:
            return [envoy_messages.immediate(exc.status, exc.message, exc.param)]
        except TurnFailed as exc:
            body = exc.body if exc.body.startswith(b"{") else b""
            return [envoy_messages.immediate(exc.status, exc.message, body=body)]

    async def _pick(self, body: Any) -> list[Response]:
        s = self.state
        if not isinstance(body, dict):
            raise RequestRejected(400, "the body must be a JSON object")
        admitted = admit_turn(
            self.headers,
            body,
            chat=self.chat,
            tenant=self.tenant,
            settings=s.gateway,
            salts=s.salts,
            arrival=self._arrival,
        )
        record_dropped(admitted.dropped, s.turns.metrics)
        turn = admitted.turn
        self._held.enter_context(s.shares.hold(turn.identity.tenant, admitted.share_tokens))
        self._span = s.tracer.start_span(
            "epp.turn", context=_PROPAGATOR.extract(self.headers), kind=trace.SpanKind.SERVER
        )
        self._span.set_attribute("kvplane.conversation", turn.identity.conversation)
        with trace.use_span(self._span, end_on_exit=False):
            prompt = await s.turns.prompt(turn)
            route, destination = await self._route(turn, prompt)
            self._span.set_attribute("kvplane.decision", route.decision)
            self._span.set_attribute("kvplane.route_id", route.route_id)
            forwarded = orjson.dumps(turn.body)
            progress = TurnProgress(route.decision, list(prompt.token_ids) or None)
            asked_ids = s.turns.decode.digesting.ask_for_token_ids(
                route.decode, client_asked=turn.client_token_ids, prompt_known=progress.prompt_ids is not None
            )
            # The sidecar reports D's answer when the picker has an endpoint for it.
            answer_id = secrets.token_hex(12) if s.answers is not None else ""
            self.relay = ResponseRelay(
                s.turns,
                turn,
                route,
                progress,
                asked_ids=asked_ids,
                chunk_bytes=s.epp.body_chunk_bytes,
                answer_id=answer_id,
            )
            token = sign(
                s.route_key,
                route,
                body=forwarded,
                return_token_ids=asked_ids,
                expires_at=time.time() + s.route_ttl_s,
                answer_to=s.answers_url if answer_id else "",
                answer_id=answer_id,
                keep_ids=turn.client_token_ids,
                collect_ids=self.relay.events.collects_ids,
                prompt_known=progress.prompt_ids is not None,
            )
            if s.answers is not None:
                s.answers.expect(answer_id, self.relay)
            trace_headers: dict[str, str] = {}
            _PROPAGATOR.inject(trace_headers)
        headers = {
            destinations.DESTINATION: destination,
            ROUTE_HEADER: token,
            "content-length": str(len(forwarded)),
            **trace_headers,
        }
        removed: tuple[str, ...] = _CLIENT_HEADERS_REMOVED if s.epp.tenant_source == "api_key" else ()
        if route.on_decode:
            # D prefills the turn itself (gateway.prefill_on_decode): no P for the sidecar to call.
            removed = (*removed, PREFILLER_HEADER)
        else:
            headers[PREFILLER_HEADER] = host_port(route.prefill.http_url)
        metadata = {destinations.LB_NAMESPACE: {destinations.DESTINATION: destination}}
        return [
            envoy_messages.request_headers(headers, removed, metadata),
            *envoy_messages.body_chunks(forwarded, s.epp.body_chunk_bytes, response=False),
        ]

    async def _route(self, turn: TurnRequest, prompt: RoutedPrompt) -> tuple[RouteResult, str]:
        """Routing's route and D's sidecar, within Envoy's subset hint when it sets one."""
        s = self.state
        subset = destinations.subset_hint(self.metadata)
        failed: tuple[str, ...] = ()
        for _ in range(s.epp.subset_attempts):
            route = await s.turns.routing.route(turn, prompt, failed=failed)
            destination = destinations.sidecar_address(
                route.decode.http_url, s.epp.sidecar_port, s.epp.sidecars
            )
            if destinations.allowed(destination, subset):
                return route, destination
            log.info("route to %s is outside the subset hint: routing again without it", destination)
            if route.route_id:
                spent = TurnProgress(route.decision, error="outside the gateway's subset hint")
                s.turns.reporter.report_later(turn, route, spent, success=False)
            failed = (*failed, route.decode.node_id)
        raise TurnFailed(503, "no endpoint in the gateway's subset hint can serve this request")
