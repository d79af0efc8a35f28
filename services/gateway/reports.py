"""ReportTurn after every turn, off the client's path, and the handle each conversation's next turn
awaits.

Reports run as tasks: a client's stream ends before its turn is reported, and no turn waits for the
previous turn's report. A turn that went as routed, whose D announced the handle it publishes
itself (or retained none), is not reported in a call of its own: its report is held to ride on
the next Route to its replica, or in one ReportTurns with the others held (`held_reports.py`).
Its conversation's next Route, if it comes first, carries it, so routing learns a turn before it
decides the next. Failed turns (their P's blocks are released at once), turns whose handle comes
from the report, and ephemeral conversations (ended right after) are reported at once.

What the next turn needs from the last one is the handle D announced in its
last chunk (`announce`): its Route names it, and routing waits for its publish (bounded) only if the
turn needs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from kvplane.services.client import RouteResult, RoutingClient, RoutingUnavailable
from kvplane.services.client.routing_client import report_request
from kvplane.services.common.model.handles import KEY_HANDLE_ID
from kvplane.services.common.runtime.bounded_map import BoundedMap
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnProgress, TurnRequest
from kvplane.services.gateway.settings import GatewaySection

log = logging.getLogger(__name__)

# Conversations whose last announced handle is remembered (an id and a count each).
_MAX_ANNOUNCED = 100_000


class TurnReporter:
    """Reports turns to routing; one per gateway."""

    def __init__(self, settings: GatewaySection, routing: RoutingClient, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.routing = routing
        self.metrics = metrics
        self._reports: set[asyncio.Task[str]] = set()
        # Per conversation (tenant, conversation), the handle its last turn's D announced: id, tokens.
        self._announced: BoundedMap[tuple[str, str], tuple[str, int]] = BoundedMap(_MAX_ANNOUNCED)

    async def drain(self, timeout_s: float) -> None:
        """Sends the reports held, and waits for reports still in flight (at shutdown)."""
        await self.routing.send_held_reports(timeout_s)
        if self._reports:
            await asyncio.wait(set(self._reports), timeout=timeout_s)

    def announce(self, turn: TurnRequest, decode_params: dict[str, Any] | None) -> None:
        """D's last chunk named the handle it retains: the conversation's next turn awaits it.

        Called as soon as the chunk is read, before the client sees it, so that a next turn sent
        the moment this one ends finds it."""
        handle_id = decode_params.get(KEY_HANDLE_ID) if decode_params else None
        if not isinstance(handle_id, str) or not handle_id or decode_params is None:
            return
        tokens = decode_params.get("remote_num_tokens")
        count = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0
        self._announced.put((turn.identity.tenant, turn.identity.conversation), (handle_id, count))

    def awaited(self, turn: TurnRequest) -> tuple[str, int]:
        """The handle (id, tokens) the conversation's last turn announced; ("", 0) if none."""
        return self._announced.get((turn.identity.tenant, turn.identity.conversation)) or ("", 0)

    def finish(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, *, success: bool, error: str = ""
    ) -> None:
        """Counts the turn's outcome (and TTFT, when it succeeded) and reports it."""
        outcome = "ok" if success else "failed"
        self.metrics.turns.labels(progress.decision, outcome).inc()
        if success and progress.ttft_s is not None:
            self.metrics.ttft.labels(progress.decision).observe(progress.ttft_s)
        if error and not progress.error:
            progress.error = error
        if log.isEnabledFor(logging.DEBUG):
            log.debug("turn", extra=turn_record(turn, route, progress, outcome))
        self.report_later(turn, route, progress, success=success)

    def report_later(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, *, success: bool
    ) -> None:
        # A finished answer's end, for routing to know which of D's load reports still count it
        # (a failed turn's D may never have had the request: it says nothing).
        ended_unix_ms = int(time.time() * 1000) if success else None
        if not success:
            # A failed turn's announcement may name blocks D never kept.
            self._announced.pop((turn.identity.tenant, turn.identity.conversation))
        elif self._holdable(turn, route, progress):
            fields = self._fields(turn, progress, success, ended_unix_ms)
            self.routing.hold_report(route, report_request(route, turn.identity.conversation, **fields))
            self.metrics.reports_held.inc()
            return
        task = asyncio.create_task(self._report(turn, route, progress, success, ended_unix_ms))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    @staticmethod
    def _holdable(turn: TurnRequest, route: RouteResult, progress: TurnProgress) -> bool:
        """Whether a successful turn's report may wait for a Route to ride on: it went as routed,
        and D publishes its handle itself (or retained none), so the report only teaches routing
        and applying it twice is harmless; an ephemeral conversation is ended right after its
        report, at once."""
        params = progress.decode_params
        announced = params is None or isinstance(params.get(KEY_HANDLE_ID), str)
        return (
            bool(route.route_id) and route.replica >= 0 and announced and turn.identity.source != "ephemeral"
        )

    @staticmethod
    def _fields(
        turn: TurnRequest, progress: TurnProgress, success: bool, ended_unix_ms: int | None
    ) -> dict[str, Any]:
        """What the turn's report says (`RoutingClient.report_turn`'s and `report_request`'s
        keyword arguments)."""
        return {
            "ended_unix_ms": ended_unix_ms,
            "success": success,
            "decode_kv_transfer_params": progress.decode_params if success else None,
            "ttft_ms": (progress.ttft_s or 0.0) * 1000,
            "prompt_tokens": len(progress.prompt_ids or ()),
            "pulled_tokens": progress.pulled_tokens,
            "cached_tokens": progress.cached_tokens,
            "prefill_ms": progress.prefill_s * 1000,
            "transfer_ms": progress.pull_ms,
            "prefill_queued_ms": progress.queued_ms,
            "retained_token_ids": progress.retained_ids_for_routing(success),
            "error": progress.error[:1000],
            "model": turn.model,
            "tenant": turn.identity.tenant,
            "prefill_kv_transfer_params": None if success else progress.prefill_params,
        }

    async def _report(
        self,
        turn: TurnRequest,
        route: RouteResult,
        progress: TurnProgress,
        success: bool,
        ended_unix_ms: int | None,
    ) -> str:
        """Reports the turn; returns the id of the handle routing published for the next turn."""
        start = time.perf_counter()
        outcome = "ok"
        handle_id = ""
        try:
            handle_id = await self.routing.report_turn(
                route if route.route_id else None,
                turn.identity.conversation,
                timeout_s=self.settings.report_timeout_s,
                **self._fields(turn, progress, success, ended_unix_ms),
            )
        except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
            # The engine's connector publishes the handle itself; a lost report only costs a sample.
            outcome = "error"
            log.warning("ReportTurn failed for %s: %s", turn.identity.conversation, exc)
        finally:
            self.metrics.legs.labels("report", outcome).observe(time.perf_counter() - start)
        if success and outcome == "ok" and turn.identity.source == "ephemeral":
            await self._end_conversation(turn)
            return ""
        return handle_id

    async def _end_conversation(self, turn: TurnRequest) -> None:
        """A request without a conversation id has no next turn: free D's blocks now, not at the TTL."""
        start = time.perf_counter()
        outcome = "error"
        key = (turn.identity.tenant, turn.identity.conversation)
        awaited, _ = self._announced.pop(key) or ("", 0)
        try:
            released = await self.routing.end_conversation(
                turn.identity.conversation,
                tenant=turn.identity.tenant,
                timeout_s=self.settings.report_timeout_s,
                awaited_handle_id=awaited,
            )
            outcome = "released" if released else "none"
        except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
            log.warning("EndConversation failed for %s: %s", turn.identity.conversation, exc)
        finally:
            self.metrics.legs.labels("end_conversation", outcome).observe(time.perf_counter() - start)


def turn_record(
    turn: TurnRequest, route: RouteResult, progress: TurnProgress, outcome: str
) -> dict[str, Any]:
    """One turn as the gateway's debug log gives it: where it went, what P found, and how long
    its first token took, so that an operator can see why a turn was slow."""
    computed = progress.sources.computed if progress.sources is not None else None
    return {
        "conversation": turn.identity.conversation,
        "tenant": turn.identity.tenant,
        "decision": progress.decision,
        "outcome": outcome,
        "prefill_node": route.prefill.node_id,
        "decode_node": route.decode.node_id,
        "prompt_tokens": len(progress.prompt_ids or ()),
        "cached_tokens": progress.cached_tokens,
        "pulled_tokens": progress.pulled_tokens,
        "computed_tokens": computed,
        "prefill_ms": round(progress.prefill_s * 1000, 1),
        "ttft_ms": None if progress.ttft_s is None else round(progress.ttft_s * 1000, 1),
        "error": progress.error[:200],
    }
