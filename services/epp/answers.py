"""The picker's answer endpoint: the sidecars' reports of D's answers (`sidecar/answer_report.py`).

With `epp.answers_listen` set, every route the picker signs names this endpoint and an answer id,
and the turn waits here, by that id, for the sidecar's report; Envoy's filter need then send the
picker no response body. A report is taken once, under the route key's HMAC; one for an unknown or
finished turn is answered 404, an unsigned one 401. A turn whose report has not come when its
decode deadline (and the report's own) has passed is reported failed, as a turn whose answer did
not reach its end through Envoy was.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Protocol

from aiohttp import web

from kvplane.services.sidecar.answer_report import ANSWER_MAC_HEADER, ANSWERS_PATH, AnswerReport, mac_verifies

log = logging.getLogger(__name__)

# A report is a few hundred bytes, plus the output's ids when asked for (4 bytes or so per token).
MAX_REPORT_BYTES = 16 << 20


class AwaitsReport(Protocol):
    def take_report(self, report: AnswerReport) -> None: ...

    def finish(self, error: str = "") -> None: ...


class PendingAnswers:
    """Turns awaiting their sidecar's report, by answer id, each until its deadline."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        # In the order they were routed, which is their deadlines' order (one wait for all).
        self._pending: OrderedDict[str, tuple[float, AwaitsReport]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def expect(self, answer_id: str, turn: AwaitsReport) -> None:
        self.expire()
        self._pending[answer_id] = (time.monotonic() + self.wait_s, turn)

    def take(self, answer_id: str) -> AwaitsReport | None:
        entry = self._pending.pop(answer_id, None)
        return entry[1] if entry is not None else None

    def forget(self, answer_id: str) -> None:
        self._pending.pop(answer_id, None)

    def expire(self, now: float | None = None) -> None:
        """Reports failed every turn past its deadline."""
        now = time.monotonic() if now is None else now
        while self._pending:
            answer_id, (deadline, turn) = next(iter(self._pending.items()))
            if deadline > now:
                return
            del self._pending[answer_id]
            turn.finish("no report of D's answer came from the sidecar")

    def close(self) -> None:
        """The picker stops: every turn still waiting is reported failed."""
        while self._pending:
            _, (_, turn) = self._pending.popitem(last=False)
            turn.finish("the picker stopped before the sidecar reported D's answer")


def answers_app(pending: PendingAnswers, key: bytes) -> web.Application:
    async def take(request: web.Request) -> web.Response:
        body = await request.read()
        if not mac_verifies(key, body, request.headers.get(ANSWER_MAC_HEADER, "")):
            return web.Response(status=401, text="the report's HMAC does not verify")
        try:
            report = AnswerReport.decode(body)
        except ValueError as exc:
            return web.Response(status=400, text=str(exc))
        turn = pending.take(report.answer_id)
        pending.expire()
        if turn is None:
            return web.Response(status=404, text="no turn awaits this report")
        turn.take_report(report)
        return web.Response(status=204)

    app = web.Application(client_max_size=MAX_REPORT_BYTES)
    app.router.add_post(ANSWERS_PATH, take)
    return app
