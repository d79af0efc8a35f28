"""The response phase of a picked turn: D's answer on its way back to the client.

Two ways, as the route says:

- The sidecar reports D's answer (`epp.answers_listen` set: the route names the picker's answer
  endpoint and an answer id). The picker needs the response's headers only (the sidecar's account
  of the P leg, `x-kvplane-prefill`, read and removed): Envoy's filter is configured to send no
  response body (`response_body_mode: NONE`; Envoy cannot be asked per request to leave
  FULL_DUPLEX_STREAMED), and a body it sends anyway passes untouched. The turn is announced and
  reported when the sidecar's report comes (`answers.py`), before the client sees its answer end.
- The picker reads D's answer itself: as in the gateway's D leg (`decode_leg.py`), each event
  goes on at once, parsed only when it can hold what the turn needs (`decode_events.DecodeEvents`):
  the first token (TTFT) and D's handle, which is announced before the client sees its event (the
  conversation's next turn may come at once) and taken out of what the client receives. When D's
  answer has ended, the turn is reported (ReportTurn, off the client's path) as the gateway
  reports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import orjson

from kvplane.services.client import RouteResult
from kvplane.services.epp import envoy_messages
from kvplane.services.epp.envoy_messages import Response
from kvplane.services.gateway.decode_events import DecodeEvents
from kvplane.services.gateway.decode_leg import CONVERSATION_HEADER, DECISION_HEADER, ROUTE_HEADER
from kvplane.services.gateway.progress import TurnProgress, TurnRequest, absorb
from kvplane.services.gateway.sse import SseParser
from kvplane.services.gateway.turn import TurnRunner
from kvplane.services.sidecar.answer_report import AnswerReport
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.signed_route import PREFILL_REPORT_HEADER

log = logging.getLogger(__name__)


class ResponseRelay:
    """One picked turn's answer, message by message; used from its ext_proc stream only."""

    def __init__(
        self,
        turns: TurnRunner,
        turn: TurnRequest,
        route: RouteResult,
        progress: TurnProgress,
        *,
        asked_ids: bool,
        chunk_bytes: int,
        answer_id: str = "",
    ) -> None:
        """`answer_id`: the sidecar reports D's answer under this id (`answers.py`); "" when the
        picker reads it from the response's body."""
        self.turns = turns
        self.answer_id = answer_id
        # When the picker answered the request: the sidecar's TTFT counts from its own receipt.
        self.routed = time.perf_counter()
        self._prefill_applied = False
        self.turn = turn
        self.route = route
        self.progress = progress
        self.chunk_bytes = chunk_bytes
        self.events = DecodeEvents(
            progress,
            asked_ids=asked_ids,
            keep_ids=turn.client_token_ids,
            collect_ids=not turns.decode.digesting.digests(route.decode),
        )
        self._parser = SseParser()
        self._whole = bytearray()
        self._ok = False
        self._announced: object = None
        self.finished = False
        self.reported = False

    def headers(self, headers: Mapping[str, str]) -> Response:
        status = headers.get(":status", "")
        self._ok = status == "200"
        report = headers.get(PREFILL_REPORT_HEADER)
        if report:
            try:
                self._apply_prefill(PrefillReport.decode(report))
            except ValueError as exc:
                log.warning("the sidecar's prefill report is unreadable: %s", exc)
        if not self._ok and not self.reported:
            self.progress.error = self.progress.error or f"the decode sidecar answered HTTP {status}"
        # The body is the sidecar's, unchanged, when it reports the answer: its length holds.
        rewritten = self._ok and not self.answer_id
        remove = [PREFILL_REPORT_HEADER, "content-length"] if rewritten else [PREFILL_REPORT_HEADER]
        return envoy_messages.response_headers(
            {
                DECISION_HEADER: self.progress.decision,
                ROUTE_HEADER: self.route.route_id,
                CONVERSATION_HEADER: self.turn.identity.conversation,
            },
            remove,
        )

    def _apply_prefill(self, prefill: PrefillReport) -> None:
        """The sidecar's P leg, once (in the answer's headers and in its report)."""
        if self._prefill_applied:
            return
        self._prefill_applied = True
        prefill.apply(self.progress)
        sources = self.progress.sources
        for source, tokens in (sources.counts() if sources else {}).items():
            self.turns.metrics.prompt_tokens.labels(source).inc(tokens)

    @property
    def awaits_report(self) -> bool:
        """The sidecar is answering (200) and will report the answer, which has not come yet."""
        return bool(self.answer_id) and self._ok and not self.reported

    def take_report(self, report: AnswerReport) -> None:
        """The sidecar's report of D's answer: the handle announced, the turn reported."""
        if self.reported:
            return
        if report.prefill is not None:
            self._apply_prefill(report.prefill)
        p = self.progress
        p.decode_params = report.decode_params
        if report.output_ids:
            p.output_ids = list(report.output_ids)
        if p.prompt_ids is None and report.prompt_ids:
            p.prompt_ids = list(report.prompt_ids)
        if report.ttft_s is not None:
            p.ttft_s = (self.routed - self.turn.arrival) + report.ttft_s
        self._ok = True
        self.finished = report.finished
        self._announce()
        self.finish(report.error)

    def body(self, chunk: bytes, end: bool) -> list[Response]:
        if self.answer_id and self._ok:
            # Envoy's filter sends response bodies (its body mode is not NONE): the sidecar's, as it is.
            return [envoy_messages.body_chunk(chunk, end, response=True)]
        if not self._ok:
            if end:
                self.finish()
            return [envoy_messages.body_chunk(chunk, end, response=True)]
        if self.turn.stream:
            out = self._stream(chunk, end)
            if end:
                self.finish()
            return [envoy_messages.body_chunk(out, end, response=True)]
        self._whole += chunk
        if not end:
            return []
        out = self._answer(bytes(self._whole))
        self.finish()
        return list(envoy_messages.body_chunks(out, self.chunk_bytes, response=True))

    def _stream(self, chunk: bytes, end: bool) -> bytes:
        out = bytearray()
        events = self._parser.feed(chunk) + (self._parser.close() if end else [])
        for event in events:
            raw, token = self.events.forward(event)
            self._announce()
            out += raw
            if self.progress.ttft_s is None and token:
                self.progress.ttft_s = time.perf_counter() - self.turn.arrival
            if event.done:
                self.finished = True
        return bytes(out)

    def _answer(self, raw: bytes) -> bytes:
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.progress.error = "the decode sidecar's answer is not JSON"
            return raw
        if not isinstance(answer, dict):
            return raw
        absorb(answer, self.progress, self.turn.client_token_ids)
        self._announce()
        self.progress.ttft_s = time.perf_counter() - self.turn.arrival
        self.finished = True
        return orjson.dumps(answer)

    def _announce(self) -> None:
        if self.progress.decode_params is not self._announced:
            # D's handle, before the client sees its event: the next turn may come at once.
            self._announced = self.progress.decode_params
            self.turns.reporter.announce(self.turn, self.progress.decode_params)

    def finish(self, error: str = "") -> None:
        """Reports the turn, once: a success when D's answer ended whole."""
        if self.reported:
            return
        self.reported = True
        success = self._ok and self.finished and not self.progress.error
        if success:
            self.turns.decode.digesting.learn(self.route.decode, self.progress.decode_params)
        self.turns.reporter.finish(
            self.turn, self.route, self.progress, success=success, error=error or self.progress.error
        )
