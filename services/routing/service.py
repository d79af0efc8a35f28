"""The routing service's gRPC adapters: principal → validate → `Router` → response.

Route, ReportTurn and EndConversation check the caller and their request, turn
protobuf into domain values, and hand them to the `Router` (`router/`), which
decides the turn, checks its handle out and learns from its report; what a
report says of D's handle and of a failed turn's P is `reports.py`'s. The
Router's ports are the replica's watch-fed view, the etcd store's check-out
and the system clock (`adapters.py`). Protobuf stops at this boundary.
StreamPrefixCache feeds the Router's view of prefill engines' caches from their
own KV-cache events (`prefix_cache_stream.py`).

The hot path (Route) reads only the watch-fed cluster view; the check-out
transaction is its one etcd round trip, and only when the policy decides to
pull. Every etcd fault degrades to a recompute from the cached view: Route
fails only when no node that could serve the turn is known.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace

from kvplane.services.common.model import convert, validation
from kvplane.services.common.model.errors import (
    HandleNotRetained,
    InvalidArgument,
    KvplaneError,
    NotFound,
    StoreUnavailable,
)
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.model.json_text import dumps_compact
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.runtime.bounded_map import BoundedMap
from kvplane.services.common.runtime.grpc_errors import rpc_method
from kvplane.services.common.runtime.server import Context, caller
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import HandleRecord, Store
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.routing import prefix_cache_stream
from kvplane.services.routing.adapters import StoreCheckOut, SystemClock, ViewCluster
from kvplane.services.routing.endpoints import AddressError, http_base_url
from kvplane.services.routing.metrics import EngineCacheBlocks, RoutingMetrics
from kvplane.services.routing.policy import Decision, Prompt, RoutingPolicy, load_policy
from kvplane.services.routing.reports import TurnReports
from kvplane.services.routing.router import (
    AwaitedHandle,
    NoRoute,
    RouteOutcome,
    Router,
    TurnReport,
    TurnRequest,
)
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.engine_caches import EngineCaches
from kvplane.services.routing.state.streamed_loads import StreamedLoads
from kvplane.services.routing.suspect_marker import MAX_FAILED_NODES, SuspectMarker
from kvplane.v1 import routing_pb2, routing_pb2_grpc

log = logging.getLogger(__name__)

# Longest EndConversation waits for the engine's own publish of the handle the conversation's
# last turn announced (off the turn path: the client has its answer), seconds.
END_PUBLISH_WAIT_S = 2.0

SERVICE_NAME = routing_pb2.DESCRIPTOR.services_by_name["RoutingService"].full_name

MAX_MODEL = 256
MAX_PROMPT_IDS = 1 << 20
MAX_ERROR = 1024
# Most reports one ReportTurns call, or one Route, carries (routing.proto).
MAX_BATCHED_REPORTS = 64
MAX_CACHE_SALT = 256
# Nodes (by id, incarnation and URL) whose encoded Endpoint is kept.
_MAX_ENDPOINTS = 4096

DECISION_TO_PB: dict[Decision, routing_pb2.Decision.ValueType] = {
    Decision.PULL: routing_pb2.DECISION_PULL,
    Decision.PULL_PREFIX: routing_pb2.DECISION_PULL_PREFIX,
    Decision.RECOMPUTE_NO_HANDLE: routing_pb2.DECISION_RECOMPUTE_NO_HANDLE,
    Decision.RECOMPUTE_BELOW_THRESHOLD: routing_pb2.DECISION_RECOMPUTE_BELOW_THRESHOLD,
    Decision.RECOMPUTE_EXPIRING: routing_pb2.DECISION_RECOMPUTE_EXPIRING,
    Decision.RECOMPUTE_HOLDER_DOWN: routing_pb2.DECISION_RECOMPUTE_HOLDER_DOWN,
    Decision.RECOMPUTE_PREFIX_MISMATCH: routing_pb2.DECISION_RECOMPUTE_PREFIX_MISMATCH,
    Decision.RECOMPUTE_COST: routing_pb2.DECISION_RECOMPUTE_COST,
    Decision.RECOMPUTE_CONTENDED: routing_pb2.DECISION_RECOMPUTE_CONTENDED,
    Decision.PREFILL_ON_DECODE: routing_pb2.DECISION_PREFILL_ON_DECODE,
}

__all__ = ["SERVICE_NAME", "NoRoute", "RouteOutcome", "RoutingService"]


def _now_ms() -> int:
    return int(time.time() * 1000)


class RoutingService(routing_pb2_grpc.RoutingServiceServicer):
    """Implements kvplane.v1.RoutingService over a cluster view and the etcd store."""

    authenticator: Any  # set by GrpcServer.add

    def __init__(
        self,
        store: Store,
        view: ClusterView,
        settings: RoutingSection,
        telemetry: Telemetry,
        policy: RoutingPolicy | None = None,
    ) -> None:
        self.store = store
        self.view = view
        self.settings = settings
        self.telemetry = telemetry
        self.metrics = RoutingMetrics.create(telemetry.registry)
        # The loads nodes stream here (StreamPrefixCache), fresher than etcd's.
        stale_s, max_nodes = settings.prefix_cache_stale_after_s, settings.prefix_cache_max_nodes
        self.streamed_loads = StreamedLoads(stale_s, max_nodes)
        self._cluster = ViewCluster(view, self.metrics, self.streamed_loads)
        # What the node agents' streams say each engine's cache holds (StreamPrefixCache).
        self.engine_caches = EngineCaches(
            stale_after_s=settings.prefix_cache_stale_after_s,
            max_nodes=settings.prefix_cache_max_nodes,
            max_blocks=settings.prefix_cache_max_blocks,
        )
        telemetry.registry.register(EngineCacheBlocks(self.engine_caches.block_counts))
        self.router = Router(
            policy or RoutingPolicy(load_policy(settings.policy_file or None)),
            settings,
            self._cluster,
            StoreCheckOut(store),
            SystemClock(),
            # Salts tie-breaks, so that replicas spread equal nodes differently.
            tie_salt=uuid.uuid4().hex[:8],
            engine_caches=self.engine_caches,
        )
        self._reports = TurnReports(store, view, settings)
        self._publish_cost_gauges()
        # Each node's Endpoint, encoded once (its URL is checked and normalised on the way).
        self._endpoints: BoundedMap[tuple[str, str, str], bytes] = BoundedMap(_MAX_ENDPOINTS)
        self._suspects = SuspectMarker(store)
        # Releases of handles that P's cache made useless, under way (kept from the collector).
        self._releasing: set[asyncio.Task[None]] = set()

    @property
    def policy(self) -> RoutingPolicy:
        return self.router.policy

    def _caller(self, context: Context) -> Principal:
        return caller(self, context)

    # -- Route ------------------------------------------------------------------

    @rpc_method
    async def Route(self, request: routing_pb2.RouteRequest, context: Context) -> routing_pb2.RouteResponse:
        start = time.perf_counter()
        principal = self._caller(context)
        tenant = principal.acts_for(request.tenant)
        principal.require_engine_access("Route")
        conversation = validation.conversation(request.conversation)
        model = validation.text(request.model, "model", max_bytes=MAX_MODEL)
        validation.ident(request.request_id, "request_id", required=False)
        prompt = _prompt(request)
        failed = self._failed_nodes(request, principal)
        awaited = validation.ident(request.awaited_handle_id, "awaited_handle_id", required=False)
        max_output = request.max_output_tokens if request.HasField("max_output_tokens") else None
        salt = validation.text(request.cache_salt, "cache_salt", max_bytes=MAX_CACHE_SALT, required=False)
        validation.count(len(request.reports), "reports", 0, MAX_BATCHED_REPORTS)
        # Held-back reports first: a conversation's last turn is learnt before its next is routed.
        await self._apply_carried(principal, request.reports)
        outcome = await self.route(
            tenant,
            conversation,
            model,
            prompt,
            time_budget_s=context.time_remaining(),
            failed_node_ids=failed,
            awaited=AwaitedHandle(awaited, request.awaited_handle_tokens) if awaited else None,
            max_output_tokens=max_output,
            cache_salt=salt or None,
            prefill_on_decode_ok=request.prefill_on_decode_ok,
        )
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "kvplane.route_id": outcome.route_id,
                    "kvplane.request_id": request.request_id,
                    "kvplane.decision": outcome.decision.value,
                    "kvplane.reason": outcome.reason,
                    "kvplane.reused_tokens": outcome.reused_tokens,
                    "kvplane.prefill_node": outcome.plan.prefill.node_id,
                    "kvplane.decode_node": outcome.plan.decode.node_id,
                }
            )
            if outcome.plan.moved_from:
                span.set_attribute("kvplane.moved_from", outcome.plan.moved_from)
        response = routing_pb2.RouteResponse(
            route_id=outcome.route_id,
            decision=DECISION_TO_PB[outcome.decision],
            reason=outcome.reason,
            prefill=self._endpoint(outcome.plan.prefill),
            decode=self._endpoint(outcome.plan.decode),
            prefill_kv_transfer_params_json=dumps_compact(outcome.prefill_params),
            expected_reused_tokens=outcome.reused_tokens,
            skip_decode_retention=outcome.skip_decode_retention,
            reports_taken=len(request.reports),
        )
        if outcome.handle_pb:
            response.handle.MergeFromString(outcome.handle_pb)
        elif outcome.handle is not None:
            response.handle.CopyFrom(convert.handle_to_pb(outcome.handle))
        self.metrics.route_seconds.observe(time.perf_counter() - start)
        return response

    def _endpoint(self, node: Node) -> routing_pb2.Endpoint:
        key = (node.node_id, node.incarnation, node.http_url)
        encoded = self._endpoints.get(key)
        if encoded is None:
            encoded = _endpoint(node).SerializeToString()
            self._endpoints.put(key, encoded)
        return routing_pb2.Endpoint.FromString(encoded)

    async def route(
        self,
        tenant: str,
        conversation: str,
        model: str,
        prompt: Prompt,
        *,
        time_budget_s: float | None = None,
        failed_node_ids: frozenset[str] = frozenset(),
        awaited: AwaitedHandle | None = None,
        max_output_tokens: int | None = None,
        cache_salt: str | None = None,
        prefill_on_decode_ok: bool = False,
    ) -> RouteOutcome:
        """The Router's decision for one turn, counted in the metrics. No protobuf here."""
        turn = TurnRequest(
            tenant,
            conversation,
            model,
            prompt,
            time_budget_s,
            failed_node_ids,
            awaited,
            max_output_tokens,
            cache_salt,
            prefill_on_decode_ok,
        )
        try:
            outcome = await self.router.route(turn)
        except NoRoute as exc:
            # With etcd out of reach the view may lack nodes: say so, not only "no pair".
            if not self.view.healthy or self.store.etcd.unreachable_since is not None:
                endpoints = ", ".join(self.store.etcd.settings.endpoints)
                raise NoRoute(f"{exc} (etcd at {endpoints} is not answering: nodes may be missing)") from None
            raise
        if outcome.handle is not None:
            life_left_s = outcome.handle.life_left_ms(outcome.routed_unix_ms) / 1000
            self.metrics.life_left_at_checkout.observe(max(0.0, life_left_s))
        decision, reused = outcome.decision, outcome.reused_tokens
        kind = (
            "pull" if decision.pulls else "decode" if decision is Decision.PREFILL_ON_DECODE else "recompute"
        )
        self.metrics.routes.labels(kind, decision.value).inc()
        self.metrics.tokens.labels("reused").inc(reused)
        self.metrics.tokens.labels("recomputed").inc(max(0, prompt.tokens - reused))
        self.metrics.decode_retention.labels("skipped" if outcome.skip_decode_retention else "kept").inc()
        if outcome.plan.moved_from:
            self.metrics.prefill_moves.inc()
        if outcome.superseded is not None:
            # No later handle will supersede this one, and P holds more than it: free D's blocks.
            self._release_later(tenant, conversation, outcome.superseded)
        return outcome

    def _release_later(self, tenant: str, conversation: str, record: HandleRecord) -> None:
        """Releases the conversation's handle off the turn's path, if it is still that one."""

        async def release() -> None:
            try:
                await self.store.release(tenant, conversation, ReleaseReason.SUPERSEDED, expected=record)
            except (HandleNotRetained, NotFound, StoreUnavailable) as exc:
                # Taken, released or expired meanwhile, or etcd is away: its TTL frees it then.
                log.debug("superseded handle of %s not released: %s", conversation, exc)

        task = asyncio.create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _failed_nodes(self, request: routing_pb2.RouteRequest, principal: Principal) -> frozenset[str]:
        """The nodes the caller says failed this turn; an operator's (a gateway's)
        report also marks them suspect for every replica."""
        validation.count(len(request.failed_node_ids), "failed_node_ids", 0, MAX_FAILED_NODES)
        failed = frozenset(validation.ident(n, "failed_node_ids") for n in request.failed_node_ids)
        if principal.kind is PrincipalKind.OPERATOR:
            now = _now_ms()
            for node_id in failed:
                record = self.view.nodes.get(node_id)
                if record is not None:
                    why = f"a leg failed (reported by {principal.name})"
                    self._suspects.mark(NodeSuspect(node_id, record.node.incarnation, now, why))
        return failed

    # -- StreamPrefixCache ------------------------------------------------------------

    @rpc_method
    async def StreamPrefixCache(
        self, request_iterator: AsyncIterator[routing_pb2.StreamPrefixCacheRequest], context: Context
    ) -> routing_pb2.StreamPrefixCacheResponse:
        counted = self.metrics.node_stream_messages
        cache_messages, load_messages = counted.labels("cache"), counted.labels("load")
        self.metrics.node_streams.inc()
        try:
            applied = await prefix_cache_stream.receive(
                self._caller(context),
                request_iterator,
                self.engine_caches,
                self.streamed_loads,
                self.router.clock.monotonic_s,
                lambda cache: (cache_messages if cache else load_messages).inc(),
                apply_caches=self.settings.engine_cache_events,
            )
        finally:
            self.metrics.node_streams.dec()
        return routing_pb2.StreamPrefixCacheResponse(applied=applied)

    # -- ReportTurn ---------------------------------------------------------------

    @rpc_method
    async def ReportTurn(
        self, request: routing_pb2.ReportTurnRequest, context: Context
    ) -> routing_pb2.ReportTurnResponse:
        handle_id = await self._report(self._caller(context), request)
        return routing_pb2.ReportTurnResponse(handle_id=handle_id)

    @rpc_method
    async def ReportTurns(
        self, request: routing_pb2.ReportTurnsRequest, context: Context
    ) -> routing_pb2.ReportTurnsResponse:
        principal = self._caller(context)
        validation.count(len(request.reports), "reports", 1, MAX_BATCHED_REPORTS)
        handle_ids = [await self._report(principal, report) for report in request.reports]
        return routing_pb2.ReportTurnsResponse(handle_ids=handle_ids)

    async def _apply_carried(self, principal: Principal, reports: Any) -> None:
        """Applies the reports a Route carries; one that fails is logged and skipped: a report
        costs the cost model a sample at most, never the turn its caller is routing."""
        for report in reports:
            try:
                await self._report(principal, report)
            except KvplaneError as exc:
                log.warning("report of %r carried by a Route skipped: %s", report.conversation[:64], exc)

    async def _report(self, principal: Principal, request: routing_pb2.ReportTurnRequest) -> str:
        """One turn's report (ReportTurn's, or one of a batch's): learnt, and D's handle named."""
        tenant = principal.acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        validation.ident(request.route_id, "route_id", required=False)
        validation.text(request.error, "error", max_bytes=MAX_ERROR, required=False)
        if len(request.retained_token_ids) > MAX_PROMPT_IDS:
            raise InvalidArgument("retained_token_ids", f"has more than {MAX_PROMPT_IDS} ids")
        report = _turn_report(request)
        route = self.router.report(request.route_id, tenant, conversation, report)
        if route is not None:
            self._publish_cost_gauges()
        handle_id = await self._reports.record(principal, tenant, conversation, report, route)
        self.metrics.reports.labels(
            "success" if request.success else "failure", str(bool(handle_id)).lower()
        ).inc()
        return handle_id

    def _publish_cost_gauges(self) -> None:
        # The cost model works in ms; metrics are in base units.
        costs = self.router.costs
        self.metrics.recompute_seconds_per_token.set(costs.recompute_ms_per_token / 1000)
        self.metrics.prefill_fixed_seconds.set(costs.prefill_fixed_ms / 1000)
        self.metrics.reused_seconds_per_token.set(costs.reused_ms_per_token / 1000)
        self.metrics.transfer_bytes_per_second.set(costs.transfer_bytes_per_ms * 1000)
        self.metrics.transfer_overhead_seconds.set(costs.transfer_overhead_ms / 1000)

    # -- EndConversation ------------------------------------------------------------

    @rpc_method
    async def EndConversation(
        self, request: routing_pb2.EndConversationRequest, context: Context
    ) -> routing_pb2.EndConversationResponse:
        tenant = self._caller(context).acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        awaited = validation.ident(request.awaited_handle_id, "awaited_handle_id", required=False)
        self.router.forget(tenant, conversation)
        if awaited:
            # The last turn's engine may still be publishing the handle: released once it lands.
            remaining = context.time_remaining()
            wait_s = END_PUBLISH_WAIT_S if remaining is None else min(END_PUBLISH_WAIT_S, remaining / 2)
            await self._cluster.wait_published(tenant, conversation, awaited, wait_s)
        cached = self.view.handle(tenant, conversation)
        try:
            await self.store.release(tenant, conversation, ReleaseReason.CONVERSATION_ENDED, expected=cached)
        except (NotFound, HandleNotRetained):
            if cached is None:
                return routing_pb2.EndConversationResponse(released=False)
            # The view may lag a newer handle: release whatever etcd holds now.
            try:
                await self.store.release(tenant, conversation, ReleaseReason.CONVERSATION_ENDED)
            except (NotFound, HandleNotRetained):
                return routing_pb2.EndConversationResponse(released=False)
        return routing_pb2.EndConversationResponse(released=True)


def _turn_report(request: routing_pb2.ReportTurnRequest) -> TurnReport:
    return TurnReport(
        success=request.success,
        prompt_tokens=request.prompt_tokens,
        pulled_tokens=request.pulled_tokens,
        cached_tokens=request.cached_tokens if request.HasField("cached_tokens") else None,
        transfer_ms=request.transfer_ms,
        prefill_ms=request.prefill_ms,
        prefill_queued_ms=request.prefill_queued_ms if request.HasField("prefill_queued_ms") else None,
        ttft_ms=request.ttft_ms,
        model=request.model,
        decode_kv_transfer_params_json=request.decode_kv_transfer_params_json,
        prefill_kv_transfer_params_json=request.prefill_kv_transfer_params_json,
        prefill_node_id=request.prefill_node_id,
        retained_token_ids=request.retained_token_ids,
        ended_unix_ms=request.ended_unix_ms if request.HasField("ended_unix_ms") else None,
    )


def _prompt(request: routing_pb2.RouteRequest) -> Prompt:
    ids = request.prompt_token_ids
    if len(ids) > MAX_PROMPT_IDS:
        raise InvalidArgument("prompt_token_ids", f"has more than {MAX_PROMPT_IDS} ids")
    tokens = request.prompt_tokens
    if ids:
        if tokens and tokens != len(ids):
            raise InvalidArgument("prompt_tokens", f"is {tokens} but prompt_token_ids has {len(ids)}")
        tokens = len(ids)
    if tokens <= 0:
        raise InvalidArgument("prompt_tokens", "must be positive (or send prompt_token_ids)")
    digests = request.prompt_block_digests
    if digests and request.prompt_digest_block_size <= 0:
        raise InvalidArgument("prompt_digest_block_size", "is required with prompt_block_digests")
    return Prompt(tokens, ids, digests, request.prompt_digest_block_size)


def _endpoint(node: Node) -> routing_pb2.Endpoint:
    try:
        url = http_base_url(node.http_url)
    except AddressError as exc:
        # Registration validates URLs, so this is a node written around the service.
        raise NoRoute(f"node {node.node_id}: {exc}") from None
    return routing_pb2.Endpoint(node_id=node.node_id, http_url=url, incarnation=node.incarnation)
