"""An async client of the routing service for gateways.

- Every call has a deadline (`timeout_s`, or the caller's own).
- A Route goes first to its conversation's home replica (`home_replica`: a
  stable hash of tenant and conversation, the same in every gateway), so that
  one replica's prompt-chain cache and record of what each P was sent see all
  of a conversation's turns; a burst of conversations still spreads over the
  replicas. Other calls rotate round-robin.
- UNAVAILABLE is retried on the next replica until the attempts or the
  deadline run out; any other status is final.
- A replica silent for `hedge_after_s` has its health checked: a frozen
  process still accepts TCP, so only a deadline tells it from a slow one,
  and a health check (no etcd, no auth) is the cheap call to time. The
  check judges liveness, not speed: its deadline (`probe_timeout_s`, 2 s)
  is one a replica that is only busy still meets, since hedging already
  covers speed. One that is refused, errs or misses it is suspect
  (`suspect_replicas`): its call is abandoned, and calls skip it at once
  until it answers a health check in the background.
  With every replica suspect a call fails at once, so that a gateway falls
  back without waiting. A Route silent that long also goes to the next
  replica at once; the first answer wins.
- A turn's ReportTurn goes first to the replica that routed it: that replica
  knows the route, and only it learns costs from the report. A report the
  caller holds (`hold_report`, `held_reports.py`) rides on the next Route to
  that replica instead, or goes with the others held for it in one
  ReportTurns within `report_hold_s`: one gRPC call fewer per turn on each
  side. A replica that predates them (its Route applies none, or ReportTurns
  is UNIMPLEMENTED) gets each held report in a ReportTurn of its own.
- Each channel carries OpenTelemetry's client interceptor, so the caller's
  current span becomes the parent of the Route span (W3C traceparent).
- `credentials` (`kvplane.services.client.credentials`) give the token and TLS; the
  control plane refuses a call without them (UNAUTHENTICATED).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.trace import TracerProvider

from kvplane.services.client.credentials import CallMetadata, ClientCredentials
from kvplane.services.client.held_reports import HeldReports, Report
from kvplane.services.client.suspect_replicas import SuspectReplicas
from kvplane.v1 import routing_pb2, routing_pb2_grpc

log = logging.getLogger(__name__)

# The name the routing service is registered under in each server's health service.
ROUTING_SERVICE = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name

DECISION_NAMES = {
    value: name.removeprefix("DECISION_").lower() for name, value in routing_pb2.Decision.items()
}


def home_replica(tenant: str, conversation: str, replicas: int) -> int:
    """The index of the replica a conversation's Routes go to first. CRC-32, not Python's
    `hash`, which is salted per process: every gateway must pick the same one."""
    return zlib.crc32(f"{tenant}\x00{conversation}".encode()) % replicas


class RoutingUnavailable(Exception):
    """No routing replica answered within the attempts and the deadline."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    node_id: str
    http_url: str
    incarnation: str


@dataclass(frozen=True, slots=True)
class RouteResult:
    """A routing decision, ready for `vllm_requests`."""

    route_id: str
    # "pull", "recompute_no_handle", ... (routing.proto's Decision, lower case).
    decision: str
    reason: str
    prefill: Endpoint
    decode: Endpoint
    prefill_params: dict[str, Any]
    expected_reused_tokens: int
    response: routing_pb2.RouteResponse = field(repr=False)
    # D need not keep this turn's KV for the next turn (RouteResponse.skip_decode_retention).
    skip_decode_retention: bool = False
    # Index of the client's replica that answered; its ReportTurn goes there first (-1: none).
    replica: int = field(default=-1, compare=False)

    @property
    def pulls(self) -> bool:
        return self.decision == "pull"

    @property
    def on_decode(self) -> bool:
        """D prefills the turn itself: no P leg; D's request carries `prefill_params`."""
        return self.decision == "prefill_on_decode"

    @classmethod
    def from_pb(cls, pb: routing_pb2.RouteResponse, replica: int = -1) -> RouteResult:
        return cls(
            route_id=pb.route_id,
            decision=DECISION_NAMES.get(pb.decision, "unspecified"),
            reason=pb.reason,
            prefill=Endpoint(pb.prefill.node_id, pb.prefill.http_url, pb.prefill.incarnation),
            decode=Endpoint(pb.decode.node_id, pb.decode.http_url, pb.decode.incarnation),
            prefill_params=json.loads(pb.prefill_kv_transfer_params_json or "{}"),
            expected_reused_tokens=pb.expected_reused_tokens,
            response=pb,
            replica=replica,
            skip_decode_retention=pb.skip_decode_retention,
        )


class RoutingClient:
    """Calls any of several routing replicas; use as an async context manager."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        metadata: Sequence[tuple[str, str]] = (),
        timeout_s: float = 1.0,
        attempts: int = 3,
        tracer_provider: TracerProvider | None = None,
        trace_calls: bool = True,
        channel_options: Sequence[tuple[str, Any]] = (),
        credentials: ClientCredentials | None = None,
        hedge_after_s: float | None = None,
        probe_timeout_s: float = 2.0,
        probe_interval_s: float = 0.25,
        report_hold_s: float = 0.25,
        stubs: Sequence[Any] | None = None,
    ) -> None:
        """`hedge_after_s`: a replica silent this long has its health checked, and a Route also
        goes to the next replica (None: neither; calls wait out their deadline).
        `probe_timeout_s`: the deadline of a health check, long enough for a busy replica: it
        tells a frozen one from a live one, not a slow one from a fast one. `probe_interval_s`:
        between health checks of a suspect replica. `trace_calls`: carry the trace context
        (and record client spans with `tracer_provider`, else the global one); a caller whose
        spans go nowhere turns it off, sparing every call the tracing interceptor.
        `report_hold_s`: the longest a held report waits for a Route to ride on.
        `stubs`: one RoutingService stub per target to call instead of a channel to it (a
        servicer in the same process); such calls are neither traced here nor health-checked,
        so `hedge_after_s` must be None."""
        if not targets:
            raise ValueError("at least one routing target is required")
        if stubs is not None and (len(stubs) != len(targets) or hedge_after_s is not None):
            raise ValueError("stubs: one per target, and no hedging (they have no health service)")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        if hedge_after_s is not None and hedge_after_s <= 0:
            raise ValueError("hedge_after_s must be positive")
        self.targets = tuple(targets)
        credentials = credentials or ClientCredentials()
        self._metadata = CallMetadata(credentials, metadata)
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.hedge_after_s = hedge_after_s
        options = [
            # Reconnect quickly to a replica that comes back.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
            *channel_options,
        ]
        interceptors = (
            aio_client_interceptors(tracer_provider=tracer_provider)  # type: ignore[no-untyped-call]
            if trace_calls
            else []
        )
        self._channels = (
            []
            if stubs is not None
            else [
                credentials.channel(target, options=options, interceptors=interceptors)
                for target in self.targets
            ]
        )
        self._stubs: list[Any] = (
            list(stubs)
            if stubs is not None
            else [routing_pb2_grpc.RoutingServiceStub(c) for c in self._channels]
        )
        self._next = itertools.count()
        self._suspects = SuspectReplicas(
            self._channels,
            self.targets,
            ROUTING_SERVICE,
            probe_timeout_s=probe_timeout_s,
            probe_interval_s=probe_interval_s,
        )
        self._held = HeldReports(len(self.targets), report_hold_s, self.send_held_reports)
        # Replicas that predate held reports: each is sent to them in a ReportTurn of its own.
        self._unbatched: set[int] = set()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata of the next call (a rotated token file is read again)."""
        return self._metadata.current()

    @property
    def suspect_replicas(self) -> frozenset[str]:
        """Targets skipped now: each went silent, missed a health check and has not answered one since."""
        return frozenset(self.targets[i] for i in self._suspects.indexes)

    async def close(self) -> None:
        await self._held.close()
        await self._suspects.close()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> RoutingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        # The stub's methods are typed as synchronous; on an aio channel they return awaitables.
        invoke: Callable[[routing_pb2_grpc.RoutingServiceStub, float], Any],
        timeout_s: float | None,
        *,
        prefer: int = -1,
    ) -> Any:
        result, _ = await self._call_on_replica(invoke, timeout_s, prefer=prefer)
        return result

    def _order(self, prefer: int) -> list[int]:
        """Replicas to ask, in order: `prefer` (else the next in turn) first, then the ones
        after it; suspects left out."""
        count = len(self._stubs)
        start = prefer if 0 <= prefer < count else next(self._next)
        order = [(start + step) % count for step in range(count)]
        return [i for i in order if i not in self._suspects][: self.attempts]

    async def _call_on_replica(
        self,
        invoke: Callable[[routing_pb2_grpc.RoutingServiceStub, float], Any],
        timeout_s: float | None,
        *,
        prefer: int = -1,
        hedge: bool = False,
    ) -> tuple[Any, int]:
        """The answer and the index of the replica that gave it; `prefer` is tried first.

        A replica silent for `hedge_after_s` has its health checked once: if that check goes
        unanswered too, the replica is frozen or gone, so it is suspect and its call abandoned
        (the next replica is asked, or the call fails); if it answers, the replica is alive and
        only slow (etcd, load), and its call keeps its deadline. `hedge`: the call is safe to
        send twice (a Route), so the next replica is asked at once as well, first answer wins.
        """
        budget = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + budget
        order = self._order(prefer)
        if not order:
            raise RoutingUnavailable(
                "every routing replica went silent and has not answered a health check since"
            )
        silent_after = self.hedge_after_s
        calls: dict[asyncio.Task[Any], tuple[int, float]] = {}  # in flight: replica, when sent
        checks: dict[asyncio.Task[bool], int] = {}  # health checks of silent replicas
        checked: set[int] = set()
        asked = 0
        last = "deadline exceeded"

        def ask_next(now: float) -> None:
            nonlocal asked
            index = order[asked]
            asked += 1
            calls[asyncio.ensure_future(invoke(self._stubs[index], deadline - now))] = (index, now)

        try:
            while (now := time.monotonic()) < deadline:
                if not calls and asked < len(order):
                    ask_next(now)
                if not calls:
                    break
                for index, sent in list(calls.values()):
                    if silent_after is not None and index not in checked and now - sent >= silent_after:
                        checked.add(index)
                        checks[self._suspects.check(index)] = index
                        if hedge and asked < len(order):
                            ask_next(now)
                wake = min(
                    [deadline]
                    + [sent + silent_after for i, sent in calls.values() if silent_after and i not in checked]
                )
                done, _ = await asyncio.wait(
                    [*calls, *checks], timeout=max(wake - now, 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    if task in checks:
                        index = checks.pop(task)
                        if not task.result():  # frozen or gone: stop waiting on it
                            last = f"{self.targets[index]} went silent and missed a health check"
                            _cancel([t for t, (i, _) in calls.items() if i == index], calls)
                        continue
                    if task not in calls:
                        continue  # abandoned above
                    index, _ = calls.pop(task)
                    try:
                        return task.result(), index
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                            raise
                        last = f"{exc.code().name}: {exc.details()}"
        finally:
            # Health checks still running go on: a miss marks their replica for the next calls.
            _cancel(list(calls), calls)
        raise RoutingUnavailable(f"no routing replica answered within {budget:.2f} s ({last})")

    async def route(
        self,
        conversation: str,
        model: str,
        *,
        prompt_tokens: int = 0,
        prompt_token_ids: Sequence[int] = (),
        prompt_block_digests: Sequence[int] = (),
        prompt_digest_block_size: int = 0,
        request_id: str = "",
        tenant: str = "",
        timeout_s: float | None = None,
        failed_node_ids: Sequence[str] = (),
        awaited_handle_id: str = "",
        awaited_handle_tokens: int = 0,
        max_output_tokens: int | None = None,
        cache_salt: str = "",
        prefill_on_decode_ok: bool = False,
    ) -> RouteResult:
        """Routes one turn; `failed_node_ids` names nodes whose leg of this very turn just
        failed (a retry), so that routing neither chooses them again nor, for others, soon.
        `awaited_handle_id` (and its tokens): the handle the previous turn's decode engine
        announced in its last chunk, which routing waits for (bounded) if it needs it and its
        publish has not landed yet. `max_output_tokens`: the turn's max_tokens, when known (D
        keeps its KV for the next turn only where the output could be worth a pull).
        `cache_salt`: the salt the turn's engine requests carry, so that routing predicts the
        prefill engines' block hashes as they compute them. `prefill_on_decode_ok`: the caller can
        run the turn on its decode engine alone (`RouteResult.on_decode`, then `decode_only_body`)."""
        request = routing_pb2.RouteRequest(
            conversation=conversation,
            model=model,
            prompt_tokens=prompt_tokens,
            prompt_token_ids=prompt_token_ids,
            prompt_block_digests=prompt_block_digests,
            prompt_digest_block_size=prompt_digest_block_size,
            request_id=request_id,
            tenant=tenant,
            failed_node_ids=failed_node_ids,
            awaited_handle_id=awaited_handle_id,
            awaited_handle_tokens=awaited_handle_tokens,
            max_output_tokens=max_output_tokens,
            cache_salt=cache_salt,
            prefill_on_decode_ok=prefill_on_decode_ok,
        )
        carried: dict[int, list[Report]] = {}

        def invoke(stub: routing_pb2_grpc.RoutingServiceStub, left: float) -> Any:
            index = next(i for i, s in enumerate(self._stubs) if s is stub)
            reports = [] if index in self._unbatched else self._held.take(index)
            sent = request
            if reports:
                carried[index] = reports
                sent = routing_pb2.RouteRequest()
                sent.CopyFrom(request)
                sent.reports.extend(reports)
            return stub.Route(sent, timeout=left, metadata=self.metadata)

        try:
            response, replica = await self._call_on_replica(
                invoke, timeout_s, prefer=home_replica(tenant, conversation, len(self._stubs)), hedge=True
            )
        except BaseException:
            for index, reports in carried.items():
                self._held.put_back(index, reports)
            raise
        for index, reports in carried.items():
            # A hedge that lost may or may not have applied its reports: applying one twice is
            # harmless (held_reports.py). A replica that took none predates them.
            if index != replica or not response.reports_taken:
                if index == replica:
                    self._unbatched.add(index)
                self._held.put_back(index, reports)
        return RouteResult.from_pb(response, replica)

    async def report_turn(
        self,
        route: RouteResult | None,
        conversation: str,
        *,
        success: bool,
        decode_kv_transfer_params: dict[str, Any] | None = None,
        ttft_ms: float = 0.0,
        prompt_tokens: int = 0,
        pulled_tokens: int = 0,
        cached_tokens: int | None = None,
        transfer_ms: float = 0.0,
        prefill_ms: float = 0.0,
        prefill_queued_ms: float | None = None,
        retained_token_ids: Sequence[int] = (),
        error: str = "",
        model: str = "",
        tenant: str = "",
        timeout_s: float | None = None,
        prefill_kv_transfer_params: dict[str, Any] | None = None,
        ended_unix_ms: int | None = None,
    ) -> str:
        """Reports a finished turn; returns the id of the handle published for the next turn.

        `prefill_kv_transfer_params`: on a failed turn, what the route's P returned; P's blocks
        held for D are then released at once. `cached_tokens`: P's own prefix-cache hits, None
        when P did not report them (routing then learns nothing of P's cache from the turn).
        `ended_unix_ms`: when the answer ended (D's request finished), by this host's clock.
        `prefill_queued_ms`: how long the prompt waited on P besides its pull, as P measured it
        (None: P did not say; routing then takes its own estimate off `prefill_ms`).
        """
        request = report_request(
            route,
            conversation,
            success=success,
            decode_kv_transfer_params=decode_kv_transfer_params,
            ttft_ms=ttft_ms,
            prompt_tokens=prompt_tokens,
            pulled_tokens=pulled_tokens,
            cached_tokens=cached_tokens,
            transfer_ms=transfer_ms,
            prefill_ms=prefill_ms,
            prefill_queued_ms=prefill_queued_ms,
            retained_token_ids=retained_token_ids,
            error=error,
            model=model,
            tenant=tenant,
            prefill_kv_transfer_params=prefill_kv_transfer_params,
            ended_unix_ms=ended_unix_ms,
        )
        return await self.send_report(request, route.replica if route is not None else -1, timeout_s)

    async def send_report(self, request: Report, replica: int = -1, timeout_s: float | None = None) -> str:
        """Sends one report (`report_request`'s) in a ReportTurn, to `replica` first; returns
        the id of the handle published for the next turn."""
        response: routing_pb2.ReportTurnResponse = await self._call(
            lambda stub, left: stub.ReportTurn(request, timeout=left, metadata=self.metadata),
            timeout_s,
            prefer=replica,
        )
        return str(response.handle_id)

    def hold_report(self, route: RouteResult, report: Report) -> None:
        """Holds `report` (`report_request`'s) of a turn `route` routed, to ride on the next
        Route to its replica, or in one ReportTurns within `report_hold_s`. Only a report that
        is harmless to apply twice may be held (`held_reports.py`)."""
        replica = route.replica if 0 <= route.replica < len(self._stubs) else 0
        self._held.hold(replica, report)

    async def send_held_reports(self, timeout_s: float | None = None) -> int:
        """Sends every held report now (ReportTurns per replica); returns how many were sent.
        A report whose call fails is dropped, as a failed ReportTurn's is: it costs a sample."""
        sent = 0
        for index in self._held.replicas_holding():
            while reports := self._held.take(index):
                try:
                    await self._send_batch(index, reports, timeout_s)
                    sent += len(reports)
                except (RoutingUnavailable, grpc.aio.AioRpcError) as exc:
                    log.warning("%d held turn reports not sent: %s", len(reports), exc)
        return sent

    async def _send_batch(self, index: int, reports: list[Report], timeout_s: float | None) -> None:
        if index not in self._unbatched:
            batch = routing_pb2.ReportTurnsRequest(reports=reports)
            try:
                await self._call(
                    lambda stub, left: stub.ReportTurns(batch, timeout=left, metadata=self.metadata),
                    timeout_s,
                    prefer=index,
                )
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._unbatched.add(index)
        for report in reports:
            await self.send_report(report, index, timeout_s)

    async def end_conversation(
        self,
        conversation: str,
        *,
        tenant: str = "",
        timeout_s: float | None = None,
        awaited_handle_id: str = "",
    ) -> bool:
        """Releases the conversation's retained KV now; True if a handle was released.
        `awaited_handle_id`: the handle the last turn announced, released once its publish lands."""
        request = routing_pb2.EndConversationRequest(
            conversation=conversation, tenant=tenant, awaited_handle_id=awaited_handle_id
        )
        response: routing_pb2.EndConversationResponse = await self._call(
            lambda stub, left: stub.EndConversation(request, timeout=left, metadata=self.metadata), timeout_s
        )
        return bool(response.released)


def report_request(
    route: RouteResult | None,
    conversation: str,
    *,
    success: bool,
    decode_kv_transfer_params: dict[str, Any] | None = None,
    ttft_ms: float = 0.0,
    prompt_tokens: int = 0,
    pulled_tokens: int = 0,
    cached_tokens: int | None = None,
    transfer_ms: float = 0.0,
    prefill_ms: float = 0.0,
    prefill_queued_ms: float | None = None,
    retained_token_ids: Sequence[int] = (),
    error: str = "",
    model: str = "",
    tenant: str = "",
    prefill_kv_transfer_params: dict[str, Any] | None = None,
    ended_unix_ms: int | None = None,
) -> Report:
    """A finished turn's report, as ReportTurn (or `RoutingClient.hold_report`) takes it;
    the arguments are `RoutingClient.report_turn`'s."""
    prefill_params = None if success else prefill_kv_transfer_params
    return routing_pb2.ReportTurnRequest(
        route_id=route.route_id if route is not None else "",
        conversation=conversation,
        success=success,
        decode_kv_transfer_params_json=(
            json.dumps(decode_kv_transfer_params, separators=(",", ":")) if decode_kv_transfer_params else ""
        ),
        ttft_ms=ttft_ms,
        prompt_tokens=prompt_tokens,
        pulled_tokens=pulled_tokens,
        cached_tokens=cached_tokens,
        transfer_ms=transfer_ms,
        prefill_ms=prefill_ms,
        prefill_queued_ms=prefill_queued_ms,
        retained_token_ids=retained_token_ids,
        error=error,
        tenant=tenant,
        model=model,
        prefill_kv_transfer_params_json=(
            json.dumps(prefill_params, separators=(",", ":")) if prefill_params else ""
        ),
        prefill_node_id=route.prefill.node_id if route is not None and prefill_params else "",
        ended_unix_ms=ended_unix_ms,
    )


def _cancel(tasks: list[asyncio.Task[Any]], calls: dict[asyncio.Task[Any], tuple[int, float]]) -> None:
    """Abandons calls: cancelled if still in flight, a finished one's error retrieved (a loser's
    error is not the caller's)."""
    for task in tasks:
        calls.pop(task, None)
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()
