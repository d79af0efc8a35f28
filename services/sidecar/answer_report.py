"""The sidecar's account of D's answer, posted to the picker that routed the turn.

The sidecar holds D's stream. When the signed route names where to report (`answer_to`, the
picker's answer endpoint, `epp.answers_listen`), the sidecar does what the picker's response phase
would: it takes D's handle out of what the client sees (and the token ids the client did not ask
for), notes when the first token came, and keeps the output's ids when the report needs them
(`decode_events.DecodeEvents`, the gateway's own pass over D's events). From the event that names
D's handle, or the stream's end, on, it holds what it forwards: the report goes first, so that the
picker announces D's handle before the client can send its next turn. Envoy's filter then sends the
picker no response body, so D's tokens pass through Envoy alone, not twice through the picker's
gRPC stream.

The report is JSON, with its HMAC-SHA256 under the route key in `x-kvplane-answer-mac`: the key
the picker and the sidecars already share, so no client can report a turn.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvplane.services.gateway import sse
from kvplane.services.gateway.decode_events import DecodeEvents
from kvplane.services.gateway.progress import TurnProgress, absorb
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.signed_route import SignedRoute

log = logging.getLogger(__name__)

ANSWER_MAC_HEADER = "x-kvplane-answer-mac"
ANSWERS_PATH = "/v1/kvplane/answers"


@dataclass(frozen=True, slots=True)
class AnswerReport:
    answer_id: str
    # D's answer reached its end ([DONE], or a whole JSON answer).
    finished: bool
    # From the sidecar's receipt of the turn to D's first token, seconds; None before one.
    ttft_s: float | None
    # D's handle (`kv_transfer_params` of its last event), None without one.
    decode_params: dict[str, Any] | None
    # D's output ids (only when the route asked for them) and the prompt's ids when D sent them.
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    # The sidecar's P leg (`x-kvplane-prefill`, also sent in the answer's headers).
    prefill: PrefillReport | None = None
    error: str = ""

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "id": self.answer_id,
                "finished": self.finished,
                "ttft_s": self.ttft_s,
                "params": self.decode_params,
                "output_ids": self.output_ids,
                "prompt_ids": self.prompt_ids,
                "prefill": self.prefill.encode() if self.prefill is not None else None,
                "error": self.error,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> AnswerReport:
        """Raises ValueError when `raw` is not one."""
        try:
            f = orjson.loads(raw)
            ttft, params, prompt = f["ttft_s"], f["params"], f["prompt_ids"]
            prefill = f["prefill"]
            if not isinstance(f["id"], str) or not isinstance(f["output_ids"], list):
                raise TypeError("id and output_ids")
            return cls(
                f["id"],
                bool(f["finished"]),
                None if ttft is None else float(ttft),
                params if isinstance(params, dict) else None,
                [int(i) for i in f["output_ids"]],
                [int(i) for i in prompt] if isinstance(prompt, list) else None,
                PrefillReport.decode(prefill) if isinstance(prefill, str) else None,
                str(f["error"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an answer report: {exc}") from None


def answer_mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def mac_verifies(key: bytes, body: bytes, given: str) -> bool:
    """No key verifies nothing (an HMAC under an empty key is one anybody can make)."""
    return bool(key) and hmac.compare_digest(answer_mac(key, body), given)


class AnswerAccount:
    """One turn's pass over D's answer in the sidecar, for the picker's report."""

    def __init__(self, signed: SignedRoute, prefill: PrefillReport | None, arrival: float) -> None:
        self.signed = signed
        self.prefill = prefill
        self.arrival = arrival
        self.progress = TurnProgress(signed.route.decision)
        if prefill is not None:
            # P's usage: D's usage is corrected to say what P did not compute, as the gateway does.
            prefill.apply(self.progress)
        self.events = DecodeEvents(
            self.progress,
            asked_ids=signed.return_token_ids,
            keep_ids=signed.keep_ids,
            collect_ids=signed.collect_ids,
        )
        self._parser = sse.SseParser()
        self.held = bytearray()
        self.finished = False
        # The report has been sent (or is on its way): it goes once.
        self.reported = False

    def feed(self, chunk: bytes) -> bytes:
        """What of D's `chunk` the client may see now (the rest waits for the report)."""
        return self._forward(self._parser.feed(chunk))

    def close(self) -> bytes:
        """D's stream ended: a trailing partial event."""
        return self._forward(self._parser.close())

    def _forward(self, events: list[sse.SseEvent]) -> bytes:
        out = bytearray()
        for event in events:
            raw, token = self.events.forward(event)
            if self.progress.ttft_s is None and token:
                self.progress.ttft_s = time.perf_counter() - self.arrival
            if event.done:
                self.finished = True
            if self.held or event.done or self.progress.decode_params is not None:
                self.held += raw
            else:
                out += raw
        return bytes(out)

    def whole(self, answer: dict[str, Any]) -> bytes:
        """D's whole answer as the client sees it."""
        absorb(answer, self.progress, self.signed.keep_ids, collect_output_ids=self.signed.collect_ids)
        self.progress.ttft_s = time.perf_counter() - self.arrival
        self.finished = True
        return orjson.dumps(answer)

    def report(self, error: str = "") -> AnswerReport:
        p = self.progress
        return AnswerReport(
            self.signed.answer_id,
            self.finished and not error,
            p.ttft_s,
            p.decode_params,
            list(p.output_ids),
            # The picker knows the prompt's ids when it routed on them: 5,000 of them each turn
            # would cost both sides more than the rest of the report.
            None if self.signed.prompt_known else p.prompt_ids,
            self.prefill,
            error,
        )


async def post_report(
    session: aiohttp.ClientSession, url: str, key: bytes, report: AnswerReport, timeout_s: float
) -> bool:
    """Posts `report` to the picker; False (logged) when it did not take it. The answer goes on to
    the client either way: a report lost costs the turn's report, never the user's answer."""
    body = report.encode()
    headers = {ANSWER_MAC_HEADER: answer_mac(key, body), "Content-Type": "application/json"}
    try:
        async with session.post(
            url.rstrip("/") + ANSWERS_PATH,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status == 204:
                return True
            log.warning("the picker did not take the answer report: HTTP %s", resp.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("the answer report did not reach the picker: %r", exc)
    return False
