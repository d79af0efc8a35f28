"""ReportTurn after every turn, off the client's path, and what the next turn of a conversation needs
from it.

Reports run as tasks: a client's stream ends before its turn is reported. The next turn of the same
conversation waits for that report (bounded), since routing can only offer the handle once it knows it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvplane.services.client import RouteResult, RoutingClient, RoutingUnavailable
from kvplane.services.common.settings import GatewaySection
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnProgress, TurnRequest

log = logging.getLogger(__name__)


class TurnReporter:
    """Reports turns to routing; one per gateway."""

    def __init__(self, settings: GatewaySection, routing: RoutingClient, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.routing = routing
        self.metrics = metrics
        self._reports: set[asyncio.Task[str]] = set()
        # The report still in flight for each conversation's last turn (tenant, conversation).
        self._last_report: dict[tuple[str, str], asyncio.Task[str]] = {}

    async def drain(self, timeout_s: float) -> None:
        """Waits for reports still in flight (at shutdown)."""
        if self._reports:
            await asyncio.wait(set(self._reports), timeout=timeout_s)

    async def after_previous(self, turn: TurnRequest) -> None:
        """Lets the report of the conversation's previous turn land before this turn is routed.

        The client's stream ends before that report is sent, and an agent may send its next turn at
        once: routed first, that turn would find no handle and recompute the whole history. Routing
        answers a report only once its view holds the handle the report names, so after this wait
        the next Route finds it.
        """
        task = self._last_report.get((turn.identity.tenant, turn.identity.conversation))
        if task is None or task.done():
            return
        start = time.perf_counter()
        _, pending = await asyncio.wait({task}, timeout=self.settings.report_timeout_s)
        outcome = "timeout" if pending else "ok"
        self.metrics.legs.labels("previous_report_wait", outcome).observe(time.perf_counter() - start)

    def report_later(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, *, success: bool
    ) -> None:
        task = asyncio.create_task(self._report(turn, route, progress, success))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

        key = (turn.identity.tenant, turn.identity.conversation)
        self._last_report[key] = task

        def forget(done: asyncio.Task[str]) -> None:
            if self._last_report.get(key) is done:
                del self._last_report[key]

        task.add_done_callback(forget)

    async def _report(
        self, turn: TurnRequest, route: RouteResult, progress: TurnProgress, success: bool
    ) -> str:
        """Reports the turn; returns the id of the handle routing published for the next turn."""
        start = time.perf_counter()
        outcome = "ok"
        handle_id = ""
        try:
            handle_id = await self.routing.report_turn(
                route if route.route_id else None,
                turn.identity.conversation,
                success=success,
                decode_kv_transfer_params=progress.decode_params if success else None,
                ttft_ms=(progress.ttft_s or 0.0) * 1000,
                prompt_tokens=len(progress.prompt_ids or ()),
                pulled_tokens=progress.pulled_tokens,
                cached_tokens=progress.cached_tokens,
                prefill_ms=progress.prefill_s * 1000,
                retained_token_ids=progress.retained_ids_for_routing(success),
                error=progress.error[:1000],
                model=turn.model,
                tenant=turn.identity.tenant,
                timeout_s=self.settings.report_timeout_s,
                prefill_kv_transfer_params=None if success else progress.prefill_params,
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
        try:
            released = await self.routing.end_conversation(
                turn.identity.conversation,
                tenant=turn.identity.tenant,
                timeout_s=self.settings.report_timeout_s,
            )
            outcome = "released" if released else "none"
        except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
            log.warning("EndConversation failed for %s: %s", turn.identity.conversation, exc)
        finally:
            self.metrics.legs.labels("end_conversation", outcome).observe(time.perf_counter() - start)
