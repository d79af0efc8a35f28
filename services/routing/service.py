"""The routing service: a decision for every turn, and a handle checked out at most once.

The hot path (Route) reads only the watch-fed cluster view; the check-out
transaction is its one etcd round trip, and only when the policy decides to
pull. Every etcd fault degrades to a recompute from the cached view: Route
fails only when no node that could serve the turn is known.

Beside the view, the replica keeps two records of its own routes, both pure
bookkeeping shared with the simulator: the work it sent each node since that
node's last load report (`inflight`), so turns arriving together do not all
see the same idle node; and the prompts it sent each prefill node
(`prefill_record`), a digest-checked hint of what that node's prefix cache
holds, so a pull brings only what P lacks. The prompt's block digests are
computed once per route (`prompt_chains`) and serve both.

Protobuf stops at this boundary: requests become a policy snapshot of
domain values, and the plan becomes a response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace

from kvplane.connector import digests as token_digests
from kvplane.services.common.model import convert, validation
from kvplane.services.common.model.errors import (
    HandleNotRetained,
    InvalidArgument,
    NodeNotRegistered,
    NotFound,
    PermissionDenied,
    StoreUnavailable,
)
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_HANDLE_ID,
    KEY_TENANT,
    CacheHandle,
    HandleFormatError,
    ReleaseReason,
    VllmHandle,
    fresh_prefill_params,
    retained_handle,
)
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.runtime.bounded_map import BoundedMap
from kvplane.services.common.runtime.grpc_errors import rpc_method
from kvplane.services.common.runtime.server import Context, caller
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import CheckOut, HandleRecord, Store
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.routing.endpoints import AddressError, bare_host, http_base_url
from kvplane.services.routing.state.inflight import InFlightLedger, routed_work
from kvplane.services.routing.metrics import RoutingMetrics
from kvplane.services.routing.policy import (
    CostModel,
    Decision,
    NodeState,
    Prompt,
    RoutePlan,
    RouteSnapshot,
    RoutingPolicy,
    TurnObservation,
    load_policy,
)
from kvplane.services.routing.policy.decision import NoEligibleNodes
from kvplane.services.routing.policy.pull_decision import pull_could_pay
from kvplane.services.routing.policy.retention import decode_retention_pays
from kvplane.services.routing.state.prefill_record import PrefillCacheRecord, SentReceipt
from kvplane.services.routing.prefill_release import prefill_hold, release_prefill
from kvplane.services.routing.state.prompt_chains import PromptChains
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.suspects import usable_nodes
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
# Part of a caller's deadline kept back from the check-out to send the answer.
_ANSWER_MARGIN_S = 0.005
# From a Route to its request reaching the engine (the caller's hop to it), ms: a load
# report taken earlier cannot show the routed work yet.
_SEND_DELAY_MS = 100
# Nodes (by id, incarnation and URL) whose encoded Endpoint is kept.
_MAX_ENDPOINTS = 4096
# Token block size for prompt digests when neither a handle nor a node says otherwise.
_DEFAULT_BLOCK_SIZE = 16

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
}


class NoRoute(StoreUnavailable):
    """No node that could serve the turn is known (UNAVAILABLE: another replica,
    or a later try once nodes register, may succeed)."""


@dataclass(frozen=True, slots=True)
class RouteRecord:
    """What ReportTurn needs to know about a route this replica made."""

    tenant: str
    conversation: str
    prefill_node_id: str
    decode_node_id: str
    holder_engine_id: str
    kv_bytes_per_token: int
    decision: Decision
    # A pull between a prefill engine and a holder that had not met before.
    first_contact: bool = False
    # What the record believed P held of the conversation, for P's report to correct.
    receipt: SentReceipt | None = None
    # The wait expected on P ahead of the turn when it was routed (ms).
    queued_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class AwaitedHandle:
    """The handle a caller saw the previous turn's decode engine announce (its id and tokens)."""

    handle_id: str
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class RouteOutcome:
    """The full result of one Route, before it becomes protobuf."""

    route_id: str
    plan: RoutePlan
    decision: Decision
    reason: str
    prefill_params: dict[str, Any]
    reused_tokens: int
    handle: CacheHandle | None
    # The checked-out handle as serialized protobuf (the claim's encoding, reused).
    handle_pb: bytes = b""
    # D need not keep this turn's KV for the next turn (`policy.retention`).
    skip_decode_retention: bool = False


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
        self.policy = policy or RoutingPolicy(load_policy(settings.policy_file or None))
        # Replaced, never mutated: a Route reads one consistent model.
        self.costs: CostModel = self.policy.config.cost_model
        self.metrics = RoutingMetrics.create(telemetry.registry)
        self._publish_cost_gauges()
        self._last_prefill: BoundedMap[tuple[str, str], str] = BoundedMap(settings.max_tracked_conversations)
        self._routes: BoundedMap[str, RouteRecord] = BoundedMap(settings.max_tracked_routes)
        self._contacted: BoundedMap[tuple[str, str], None] = BoundedMap(settings.max_tracked_conversations)
        # Each node's Endpoint, encoded once (its URL is checked and normalised on the way).
        self._endpoints: BoundedMap[tuple[str, str, str], bytes] = BoundedMap(_MAX_ENDPOINTS)
        self._inflight = InFlightLedger(limit=max(1, settings.max_tracked_routes))
        self._prefill_record = PrefillCacheRecord(
            max_conversations=max(1, settings.max_tracked_conversations)
        )
        self._chains = PromptChains(max_conversations=max(1, settings.max_tracked_conversations))
        # Salts tie-breaks, so that replicas spread equal nodes differently.
        self._replica_salt = uuid.uuid4().hex[:8]
        # The last time a Route saw the view connected to etcd (ms since the epoch).
        self._view_live_ms = 0
        self._suspects = SuspectMarker(store)
        # Releases of handles that P's cache made useless, under way (kept from the collector).
        self._releasing: set[asyncio.Task[None]] = set()

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
        outcome = await self.route(
            tenant,
            conversation,
            model,
            prompt,
            time_budget_s=context.time_remaining(),
            failed_node_ids=failed,
            awaited=AwaitedHandle(awaited, request.awaited_handle_tokens) if awaited else None,
            max_output_tokens=max_output,
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
        response = routing_pb2.RouteResponse(
            route_id=outcome.route_id,
            decision=DECISION_TO_PB[outcome.decision],
            reason=outcome.reason,
            prefill=self._endpoint(outcome.plan.prefill),
            decode=self._endpoint(outcome.plan.decode),
            prefill_kv_transfer_params_json=json.dumps(outcome.prefill_params, separators=(",", ":")),
            expected_reused_tokens=outcome.reused_tokens,
            skip_decode_retention=outcome.skip_decode_retention,
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
    ) -> RouteOutcome:
        """Decides one turn and, for a pull, checks the handle out. No protobuf here.

        `time_budget_s` is what is left of the caller's deadline: the check-out
        gets no more than that, so a short deadline yields a recompute, not an error.
        `awaited`: the handle the caller saw the previous turn's engine announce
        (`_await_publish`). `max_output_tokens`: the turn's bound on its output, if known
        (whether D keeps its KV: `policy.retention`).
        """
        key = (tenant, conversation)
        record = self.view.handle(tenant, conversation)
        all_states = self._node_states()
        if all_states and not any(st.node.fingerprint.model == model for st in all_states):
            # Nodes are known, none serves this model: the request's own error, not an outage.
            raise NotFound(f"model {model!r} is not served by any node")
        prompt = self._chains.with_chain(key, prompt, self._digest_block_size(record, all_states))
        prefill_cached = self._prefill_record.cached_tokens(
            key, prompt.tokens, prompt.block_digests, prompt.digest_block_size
        )
        if awaited is not None and (record is None or record.handle.handle_id != awaited.handle_id):
            started = time.monotonic()
            record = await self._await_publish(key, awaited, prompt, prefill_cached, time_budget_s) or record
            if time_budget_s is not None:
                time_budget_s -= time.monotonic() - started
            all_states = self._node_states()
        now = _now_ms()
        if self.view.healthy:
            self._view_live_ms = now
        states = usable_nodes(all_states, self.view.suspects, failed_node_ids)
        snapshot = RouteSnapshot(
            model=model,
            conversation=conversation,
            prompt=prompt,
            nodes=self._inflight.current(states, now, costs=self.costs),
            now_unix_ms=now,
            handle=record.handle if record is not None else None,
            last_prefill_node_id=self._last_prefill.get(key) or "",
            contacted=self._contacted,
            loads_as_of_unix_ms=now if self.view.healthy else self._loads_as_of(),
            prefill_cached_tokens=prefill_cached,
            tie_salt=self._replica_salt,
        )
        try:
            plan = self.policy.route(snapshot, self.costs)
        except NoEligibleNodes as exc:
            if len(states) == len(all_states):
                raise NoRoute(str(exc)) from None
            # Only failed or suspect nodes could serve the turn: trying one beats failing it.
            snapshot = replace(snapshot, nodes=self._inflight.current(all_states, now, costs=self.costs))
            try:
                plan = self.policy.route(snapshot, self.costs)
            except NoEligibleNodes as again:
                raise NoRoute(str(again)) from None
        route_id = uuid.uuid4().hex
        decision, reason = plan.decision, plan.verdict.reason
        checked: CheckOut | None = None
        if decision.pulls and record is not None:
            checked, reason = await self._check_out(
                tenant, conversation, route_id, record, now, time_budget_s
            )
            if checked is None:
                decision = Decision.RECOMPUTE_CONTENDED
        handle = checked.handle if checked is not None else None
        clip = plan.verdict.reusable_tokens if decision is Decision.PULL_PREFIX else 0
        params = self._prefill_params(tenant, conversation, handle, clip_to_tokens=clip)
        reused = plan.verdict.reusable_tokens if handle is not None else 0
        self._last_prefill.put(key, plan.prefill.node_id)
        receipt = self._account(route_id, key, snapshot, plan, handle is not None)
        holder_engine = snapshot.handle.vllm.remote_engine_id if snapshot.handle is not None else ""
        first_contact = False
        if handle is not None:
            pair = (plan.prefill.node_id, holder_engine)
            first_contact = pair not in self._contacted
            self._contacted.put(pair, None)
        self._routes.put(
            route_id,
            RouteRecord(
                tenant,
                conversation,
                plan.prefill.node_id,
                plan.decode.node_id,
                holder_engine,
                plan.decode.kv_bytes_per_token,
                decision,
                first_contact,
                receipt,
                _queued_ms(snapshot, plan.prefill.node_id, self.costs),
            ),
        )
        self.metrics.routes.labels("pull" if decision.pulls else "recompute", decision.value).inc()
        self.metrics.tokens.labels("reused").inc(reused)
        self.metrics.tokens.labels("recomputed").inc(max(0, prompt.tokens - reused))
        handle_pb = checked.handle_pb if checked is not None else b""
        keeps = self._prefill_record.keeps_until_next_turn(plan.prefill, receipt, prompt.tokens)
        skip_retention = not decode_retention_pays(
            keeps, max_output_tokens, plan.decode.kv_bytes_per_token, self.costs, self.policy.config.pull
        )
        self.metrics.decode_retention.labels("skipped" if skip_retention else "kept").inc()
        if skip_retention and record is not None and checked is None:
            # No later handle will supersede this one, and P holds more than it: free D's blocks.
            self._release_later(tenant, conversation, record)
        return RouteOutcome(
            route_id, plan, decision, reason, params, reused, handle, handle_pb, skip_retention
        )

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

    async def _await_publish(
        self,
        key: tuple[str, str],
        awaited: AwaitedHandle,
        prompt: Prompt,
        prefill_cached: Mapping[str, int],
        time_budget_s: float | None,
    ) -> HandleRecord | None:
        """The awaited handle once the view holds it, or None; waits only when it pays.

        D's connector publishes its handle as the turn ends, asynchronously, and a caller may
        send the next turn at once: routed before the publish lands, the turn would find no
        handle. Nothing holds the turn for the previous turn's report; only a turn that needs
        the handle waits for it, bounded by `publish_wait_s` and the caller's deadline. A
        prefill node believed to hold the history already (its prefix cache) needs no pull,
        so then the turn goes on at once.
        """
        held = max(prefill_cached.values(), default=0)
        wanted = min(awaited.tokens, prompt.tokens - 1) if awaited.tokens > 0 else prompt.tokens - 1
        # What P lacks (the last answer, say) may be cheaper to recompute than to pull: then
        # the handle would not be used, and waiting for it would only delay the turn.
        holder_bytes = max(
            (r.node.kv_bytes_per_token for r in self.view.nodes.values() if r.node.role.can_decode()),
            default=0,
        )
        if not pull_could_pay(wanted - held, holder_bytes, self.costs, self.policy.config.pull):
            return None
        wait_s = self.settings.publish_wait_s
        if time_budget_s is not None:
            # Leave the check-out and the answer their share of the caller's deadline.
            wait_s = min(wait_s, time_budget_s / 2)
        if wait_s <= 0:
            return None
        tenant, conversation = key

        start = time.perf_counter()
        landed = await self._wait_published(tenant, conversation, awaited.handle_id, wait_s)
        outcome = "published" if landed else "timeout"
        self.metrics.publish_waits.labels(outcome).observe(time.perf_counter() - start)
        return self.view.handle(tenant, conversation) if landed else None

    async def _wait_published(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        """Whether the view holds `handle_id` for the conversation, waiting up to `wait_s` for it."""

        def published() -> bool:
            current = self.view.handle(tenant, conversation)
            return current is not None and current.handle.handle_id == handle_id

        if published():
            return True
        if wait_s <= 0:
            return False
        self.metrics.publish_waiting.inc()
        try:
            return await self.view.wait_for(published, wait_s)
        finally:
            self.metrics.publish_waiting.dec()

    def _account(
        self, route_id: str, key: tuple[str, str], snapshot: RouteSnapshot, plan: RoutePlan, pulled: bool
    ) -> SentReceipt:
        """Records the route's work on its nodes, and what P's prefix cache will hold."""
        self._inflight.add(
            *routed_work(
                route_id,
                snapshot,
                plan,
                self.costs,
                pulled=pulled,
                send_delay_ms=_SEND_DELAY_MS,
                # vLLM's D gets the turn from P, once P is done with it.
                decode_after_prefill=True,
            )
        )
        prompt = snapshot.prompt
        return self._prefill_record.sent(
            key, plan.prefill, prompt.tokens, prompt.block_digests, prompt.digest_block_size
        )

    def _digest_block_size(self, record: HandleRecord | None, states: tuple[NodeState, ...]) -> int:
        """The block size to digest the prompt with: the handle's, else the prefill nodes'."""
        if record is not None and record.handle.digests is not None:
            return record.handle.digests.block_size
        for state in states:
            if state.node.role.can_prefill() and state.node.block_size > 0:
                return state.node.block_size
        return _DEFAULT_BLOCK_SIZE

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

    def _loads_as_of(self) -> int:
        """While etcd is unreachable: when the view was last known to be live."""
        newest_report = max((load.reported_unix_ms for load in self.view.loads.values()), default=0)
        return max(self._view_live_ms, newest_report)

    def _node_states(self) -> tuple[NodeState, ...]:
        view = self.view
        return tuple(NodeState(r.node, view.load(r.node)) for r in view.nodes.values())

    async def _check_out(
        self,
        tenant: str,
        conversation: str,
        route_id: str,
        record: HandleRecord,
        now: int,
        time_budget_s: float | None,
    ) -> tuple[CheckOut | None, str]:
        """The check-out, or None with the reason the handle could not be checked out."""
        if not self.view.healthy:
            # A stale view may still hold a handle that is gone; without etcd the
            # check-out cannot be made, so this turn recomputes.
            return None, "etcd unreachable: recomputing from the cached view"
        timeout_s = self.settings.checkout_timeout_s
        if time_budget_s is not None:
            # Keep a little of the caller's deadline to send the answer.
            timeout_s = min(timeout_s, time_budget_s - _ANSWER_MARGIN_S)
            if timeout_s <= 0:
                return None, "caller's deadline too short to check the handle out"
        try:
            # asyncio.timeout, not wait_for: no extra task on the hot path.
            async with asyncio.timeout(timeout_s):
                checked = await self.store.check_out(tenant, conversation, route_id=route_id, expected=record)
        except (HandleNotRetained, NotFound):
            return None, "another turn of the conversation took the handle"
        except (StoreUnavailable, TimeoutError) as exc:
            # A timed-out check-out may still apply: then nobody reads the blocks
            # and D frees them at its TTL. Never a double read.
            log.warning("check-out failed, recomputing: %s", exc)
            return None, "etcd unreachable: recomputing"
        life_left_s = checked.handle.life_left_ms(now) / 1000
        self.metrics.life_left_at_checkout.observe(max(0.0, life_left_s))
        return checked, f"checked out handle {checked.handle.handle_id}"

    def _prefill_params(
        self, tenant: str, conversation: str, handle: CacheHandle | None, *, clip_to_tokens: int = 0
    ) -> dict[str, Any]:
        """The P leg's kv_transfer_params: every vLLM key of the handle untouched (but for
        a prefix pull, clipped to the verified prefix), plus our keys so that the engines'
        connectors can check and publish."""
        if handle is None:
            params = fresh_prefill_params()
        else:
            params = handle.prefill_kv_transfer_params()
            if handle.digests is not None:
                params[KEY_DIGESTS] = token_digests.encode(handle.digests)
                if clip_to_tokens > 0:
                    clip_pull(params, clip_to_tokens, handle.digests.block_size)
        params[KEY_TENANT] = tenant
        params[KEY_CONVERSATION] = conversation
        return params

    # -- ReportTurn ---------------------------------------------------------------

    @rpc_method
    async def ReportTurn(
        self, request: routing_pb2.ReportTurnRequest, context: Context
    ) -> routing_pb2.ReportTurnResponse:
        principal = self._caller(context)
        tenant = principal.acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        validation.ident(request.route_id, "route_id", required=False)
        validation.text(request.error, "error", max_bytes=MAX_ERROR, required=False)
        if len(request.retained_token_ids) > MAX_PROMPT_IDS:
            raise InvalidArgument("retained_token_ids", f"has more than {MAX_PROMPT_IDS} ids")
        route = self._routes.pop(request.route_id) if request.route_id else None
        if route is not None:
            # The turn is over: its work has left P's queue and D's batch.
            self._inflight.finished(request.route_id)
        if route is not None and (route.tenant, route.conversation) == (tenant, conversation):
            # Only turns this replica routed teach the cost model, once each, so
            # made-up reports cannot steer it.
            self._learn(request, route)
        handle_id = ""
        if request.success and request.decode_kv_transfer_params_json:
            params = _decode_params(request.decode_kv_transfer_params_json, tenant, conversation)
            if principal.kind is PrincipalKind.TENANT or _announced_handle_id(params):
                # The engine's connector publishes its handles itself (it announces each one's id
                # in D's params): one writer per handle, and nothing here waits for it. A tenant
                # could name any blocks on any engine here, and so make P read another tenant's
                # KV: handles from tenant callers are only ever taken from the engine.
                handle_id = self._published_by_engine(tenant, conversation, params)
            else:
                # The named fallback: D without kvplane's connector announces no handle and
                # publishes nothing, so the operator's report is the only source of its handle.
                handle_id = await self._publish_from_report(tenant, conversation, params, request)
        if not request.success and request.prefill_kv_transfer_params_json:
            await self._release_prefill(request, route, principal, tenant, conversation)
        self.metrics.reports.labels(
            "success" if request.success else "failure", str(bool(handle_id)).lower()
        ).inc()
        return routing_pb2.ReportTurnResponse(handle_id=handle_id)

    async def _release_prefill(
        self,
        request: routing_pb2.ReportTurnRequest,
        route: RouteRecord | None,
        principal: Principal,
        tenant: str,
        conversation: str,
    ) -> None:
        """Frees the blocks a failed turn's P holds for D (prefill_release.py). A tenant may ask
        only for a route this replica made for it, to that node; the gateway for any turn."""
        hold = prefill_hold(request.prefill_kv_transfer_params_json, request.prefill_node_id, self.view.nodes)
        own = route is not None and (route.tenant, route.conversation, route.prefill_node_id) == (
            tenant,
            conversation,
            request.prefill_node_id,
        )
        if hold is None or not (own or principal.kind is PrincipalKind.OPERATOR):
            return
        try:
            await release_prefill(self.store, hold, tenant, conversation)
        except StoreUnavailable as exc:
            # P's own lease frees the blocks later: the report itself must not fail for this.
            log.warning("could not queue the release of %s's held prefill: %s", hold.node_id, exc)

    def _published_by_engine(self, tenant: str, conversation: str, params: dict[str, Any]) -> str:
        """The id of the handle D's connector announced for this turn if the view holds it
        already, else empty: the engine publishes asynchronously, and the next turn's Route
        (which names the handle it awaits) is what waits for it, not the report."""
        wanted = _announced_handle_id(params)
        current = self.view.handle(tenant, conversation)
        return wanted if wanted and current is not None and current.handle.handle_id == wanted else ""

    def _learn(self, request: routing_pb2.ReportTurnRequest, route: RouteRecord) -> None:
        observation = TurnObservation(
            prompt_tokens=request.prompt_tokens,
            pulled_tokens=request.pulled_tokens,
            cached_tokens=request.cached_tokens,
            transfer_ms=max(0.0, request.transfer_ms),
            prefill_ms=max(0.0, request.prefill_ms),
            ttft_ms=max(0.0, request.ttft_ms),
            kv_bytes_per_token=route.kv_bytes_per_token,
            success=request.success,
            first_contact=route.first_contact,
            queued_ms=route.queued_ms,
        )
        self.costs = self.costs.observe(observation)
        self._publish_cost_gauges()
        prefill = self.view.nodes.get(route.prefill_node_id)
        if request.success and request.HasField("cached_tokens") and route.receipt and prefill:
            # What P found in its own cache corrects what this replica believes it holds, at once.
            node = prefill.node
            self._prefill_record.observed(node, route.receipt, request.cached_tokens, node.block_size)

    def _publish_cost_gauges(self) -> None:
        # The cost model works in ms; metrics are in base units.
        self.metrics.recompute_seconds_per_token.set(self.costs.recompute_ms_per_token / 1000)
        self.metrics.prefill_fixed_seconds.set(self.costs.prefill_fixed_ms / 1000)
        self.metrics.reused_seconds_per_token.set(self.costs.reused_ms_per_token / 1000)
        self.metrics.transfer_bytes_per_second.set(self.costs.transfer_bytes_per_ms * 1000)

    async def _publish_from_report(
        self, tenant: str, conversation: str, params: dict[str, Any], request: routing_pb2.ReportTurnRequest
    ) -> str:
        """Publishes the handle of a D that announces none (no kvplane connector) from its params."""
        handle = self._handle_from_report(tenant, conversation, params, request)
        outcome = await self.store.publish_handle(handle)
        return outcome.handle.handle_id

    def _handle_from_report(
        self, tenant: str, conversation: str, params: dict[str, Any], request: routing_pb2.ReportTurnRequest
    ) -> CacheHandle:
        field = "decode_kv_transfer_params_json"
        try:
            vllm = VllmHandle.from_kv_transfer_params(params)
        except HandleFormatError as exc:
            raise InvalidArgument(field, str(exc)) from None
        if not vllm.remote_block_ids or not vllm.remote_block_ids[0] or vllm.remote_num_tokens <= 0:
            raise InvalidArgument(field, "retains no blocks")
        # Stored bare (metadata validation); vLLM brackets IPv6 itself.
        vllm = _with_host(vllm, bare_host(vllm.remote_host))
        holder = self._holder_for_engine(vllm.remote_engine_id)
        if request.model and request.model != holder.fingerprint.model:
            raise InvalidArgument(
                "model", f"is {request.model!r} but the holder serves {holder.fingerprint.model!r}"
            )
        digests = None
        encoded = params.get(KEY_DIGESTS)
        if isinstance(encoded, str) and encoded:
            try:
                digests = token_digests.decode(encoded)
            except token_digests.DigestFormatError as exc:
                raise InvalidArgument(f"{field}.{KEY_DIGESTS}", str(exc)) from None
        elif request.retained_token_ids:
            retained = request.retained_token_ids[: vllm.remote_num_tokens]
            digests = token_digests.digest_tokens(retained, holder.block_size)
        now = _now_ms()
        handle = retained_handle(
            vllm,
            tenant=tenant,
            conversation=conversation,
            handle_id=uuid.uuid4().hex,
            now_unix_ms=now,
            life_s=self.settings.decode_kv_ttl_s,
            expiry_margin_s=self.settings.expiry_margin_s,
            bytes_per_block=holder.block_size * holder.kv_bytes_per_token,
            model=holder.fingerprint.model,
            digests=digests,
            holder_node_id=holder.node_id,
            holder_incarnation=holder.incarnation,
        )
        # The same bounds PublishHandles applies: no method stores less checked input.
        return validation.cache_handle(handle, field, now_unix_ms=now)

    def _holder_for_engine(self, engine_id: str) -> Node:
        for record in self.view.nodes.values():
            if record.node.engine_id == engine_id:
                return record.node
        raise NodeNotRegistered(f"no registered node has engine id {engine_id!r}")

    # -- EndConversation ------------------------------------------------------------

    @rpc_method
    async def EndConversation(
        self, request: routing_pb2.EndConversationRequest, context: Context
    ) -> routing_pb2.EndConversationResponse:
        tenant = self._caller(context).acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        awaited = validation.ident(request.awaited_handle_id, "awaited_handle_id", required=False)
        self._last_prefill.pop((tenant, conversation))
        self._prefill_record.forget((tenant, conversation))
        self._chains.forget((tenant, conversation))
        if awaited:
            # The last turn's engine may still be publishing the handle: released once it lands.
            remaining = context.time_remaining()
            wait_s = END_PUBLISH_WAIT_S if remaining is None else min(END_PUBLISH_WAIT_S, remaining / 2)
            await self._wait_published(tenant, conversation, awaited, wait_s)
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


def _announced_handle_id(params: Mapping[str, Any]) -> str:
    """The id of the handle D's kvplane connector announced in its params (it publishes it)."""
    wanted = params.get(KEY_HANDLE_ID)
    return wanted if isinstance(wanted, str) else ""


def _decode_params(text: str, tenant: str, conversation: str) -> dict[str, Any]:
    """D's finish-time kv_transfer_params, checked against the caller's turn."""
    field = "decode_kv_transfer_params_json"
    try:
        params = json.loads(text)
    except ValueError:
        raise InvalidArgument(field, "is not JSON") from None
    if not isinstance(params, dict):
        raise InvalidArgument(field, "must be a JSON object")
    # The engine's connector echoes the tenant it was given; a mismatch means
    # the caller is reporting someone else's turn.
    for key, mine in ((KEY_TENANT, tenant), (KEY_CONVERSATION, conversation)):
        if key in params and params[key] != mine:
            raise PermissionDenied(f"{field}: {key} does not match the caller's turn")
    return params


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


def clip_pull(params: dict[str, Any], tokens: int, block_size: int) -> None:
    """Clips a pull to its first `tokens` tokens: P's vLLM then reads only those blocks.

    vLLM pulls `min(remote_num_tokens, prompt) - local hit` tokens from the tail of
    `remote_block_ids`, so both are cut to the verified prefix, as the prefill
    connector's own check does (`kvplane.connector.prefix_check`).
    """
    blocks = -(-tokens // block_size)
    params["remote_block_ids"] = [list(group[:blocks]) for group in params["remote_block_ids"]]
    params["remote_num_tokens"] = tokens


def _with_host(vllm: VllmHandle, host: str) -> VllmHandle:
    return vllm if host == vllm.remote_host else replace(vllm, remote_host=host)


def _queued_ms(snapshot: RouteSnapshot, node_id: str, costs: CostModel) -> float:
    """The wait the snapshot shows on `node_id` ahead of a new turn (ms)."""
    state = next((s for s in snapshot.nodes if s.node.node_id == node_id), None)
    return costs.queue_ms(state) if state is not None else 0.0
