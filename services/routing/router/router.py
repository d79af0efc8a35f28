"""One routing replica's turns: snapshot → plan → account → learn.

- snapshot: the turn's prompt (its digest chain, `state.prompt_chains`), the
  conversation's handle, the usable nodes with the work this router sent them
  since their last load report (`state.inflight`), and what it believes each
  prefill node's cache holds: its engine's own events where they are fresh
  (`state.engine_caches`), else this router's record (`state.prefill_record`);
- plan: the routing policy (`policy/`, pure), then the check-out of the handle
  for a pull, through the injected `HandleCheckOut`: a check-out that fails
  makes the turn recompute, never fail;
- account: the routed work on its nodes, the prompt sent to P, the route kept
  for its report (`state.routes`);
- learn: a reported turn updates the cost model and corrects the prefill record.

The cluster, the check-out and the clock are ports (`ports.py`): the routing
service wraps this class with its gRPC adapters, and the simulator calls the
very same class over its fleet, so simulated and live routing cannot drift.
No protobuf here: domain values in, domain values out.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

from kvplane.services.common.model.errors import HandleNotRetained, NotFound, StoreUnavailable
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.store.records import CheckOut, HandleRecord, HandleReplaced
from kvplane.services.routing.policy import (
    CostModel,
    Decision,
    NodeState,
    Prompt,
    RoutePlan,
    RouteSnapshot,
    RoutingPolicy,
    TurnObservation,
)
from kvplane.services.routing.policy.decision import NoEligibleNodes
from kvplane.services.routing.policy.decode_prefill import handle_could_serve_on_decode
from kvplane.services.routing.policy.pull_decision import pull_could_pay
from kvplane.services.routing.policy.retention import decode_retention_pays
from kvplane.services.routing.router.ports import Clock, ClusterReader, HandleCheckOut, PrefixCacheViews
from kvplane.services.routing.router.turns import AwaitedHandle, RouteOutcome, TurnReport, TurnRequest
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.inflight import InFlightLedger, routed_work
from kvplane.services.routing.state.prefill_record import PrefillCacheRecord, SentReceipt
from kvplane.services.routing.state.prompt_chains import PromptChains
from kvplane.services.routing.state.routes import RouteBook, RouteRecord
from kvplane.services.routing.state.suspects import usable_nodes
from kvplane.services.routing.transfer_params import decode_only_params, prefill_params

log = logging.getLogger(__name__)

# Part of a caller's deadline kept back from the check-out to send the answer.
_ANSWER_MARGIN_S = 0.005
# Token block size for prompt digests when neither a handle nor a node says otherwise.
_DEFAULT_BLOCK_SIZE = 16


class NoRoute(StoreUnavailable):
    """No node that could serve the turn is known (UNAVAILABLE: another replica,
    or a later try once nodes register, may succeed)."""


def _new_route_id() -> str:
    return uuid.uuid4().hex


class Router:
    """Routes turns and learns from their reports; the routing service's and the simulator's."""

    def __init__(
        self,
        policy: RoutingPolicy,
        settings: RoutingSection,
        cluster: ClusterReader,
        checkout: HandleCheckOut,
        clock: Clock,
        *,
        tie_salt: str = "",
        new_route_id: Callable[[], str] = _new_route_id,
        engine_caches: PrefixCacheViews | None = None,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.cluster = cluster
        self.checkout = checkout
        self.clock = clock
        # Salts tie-breaks, so that replicas spread equal nodes differently.
        self.tie_salt = tie_salt
        self._new_route_id = new_route_id
        # What prefill engines' events say their caches hold (None: no events; the record only).
        self.engine_caches = engine_caches
        # Replaced, never mutated: a route reads one consistent model.
        self.costs: CostModel = policy.config.cost_model
        self._book = RouteBook(
            max_routes=settings.max_tracked_routes,
            max_conversations=settings.max_tracked_conversations,
            active_s=settings.active_conversation_s,
        )
        self._inflight = InFlightLedger(limit=max(1, settings.max_tracked_routes))
        self._prefill_record = PrefillCacheRecord(
            max_conversations=max(1, settings.max_tracked_conversations)
        )
        self._chains = PromptChains(max_conversations=max(1, settings.max_tracked_conversations))
        # The last time a route saw the cluster view live (ms since the epoch).
        self._view_live_ms = 0

    @property
    def prefill_record(self) -> PrefillCacheRecord:
        """What this router believes each prefill node's cache holds (read it, do not change it)."""
        return self._prefill_record

    # -- route --------------------------------------------------------------------------------

    async def route(self, turn: TurnRequest) -> RouteOutcome:
        """Decides one turn and, for a pull, checks the handle out.

        `turn.time_budget_s` is what is left of the caller's deadline: the check-out
        gets no more than that, so a short deadline yields a recompute, not an error.
        """
        key = (turn.tenant, turn.conversation)
        snapshot, record, states, time_budget_s = await self._snapshot(turn)
        plan = self._plan(snapshot, states)
        route_id = self._new_route_id()
        decision, reason = plan.decision, plan.verdict.reason
        checked: CheckOut | None = None
        if decision.pulls and record is not None:
            checked, reason, current = await self._check_out(turn, route_id, record, time_budget_s)
            if current is not None:
                # The view was behind etcd (the conversation's last turn published a handle this
                # replica had not seen yet, as when another gateway carried that turn): plan again,
                # once, on the handle etcd holds.
                record = current
                snapshot = replace(snapshot, handle=current.handle)
                plan = self._plan(snapshot, states)
                decision, reason = plan.decision, plan.verdict.reason
                if decision.pulls:
                    checked, reason, _ = await self._check_out(turn, route_id, record, time_budget_s)
            if decision.pulls and checked is None:
                decision = Decision.RECOMPUTE_CONTENDED
        handle = checked.handle if checked is not None else None
        on_decode = decision is Decision.PREFILL_ON_DECODE
        if on_decode:
            # D's own leg: the handle stays D's (its next publish supersedes it), nothing is read.
            params = decode_only_params(turn.tenant, turn.conversation)
        else:
            clip = plan.verdict.reusable_tokens if decision is Decision.PULL_PREFIX else 0
            params = prefill_params(
                turn.tenant, turn.conversation, handle, clip_to_tokens=clip, route_id=route_id
            )
        reused = plan.verdict.reusable_tokens if handle is not None or on_decode else 0
        receipt = self._account(route_id, key, snapshot, plan, handle is not None or on_decode)
        holder_engine = snapshot.handle.vllm.remote_engine_id if snapshot.handle is not None else ""
        first_contact = False
        if handle is not None:
            first_contact = self._book.contact(plan.prefill.node_id, holder_engine)
        self._book.routed(
            route_id,
            RouteRecord(
                turn.tenant,
                turn.conversation,
                plan.prefill.node_id,
                plan.decode.node_id,
                holder_engine,
                plan.decode.kv_bytes_per_token,
                decision,
                first_contact,
                receipt,
                _queued_ms(snapshot, plan.prefill.node_id, self.costs),
            ),
            self.clock.monotonic_s(),
        )
        # No prefill node sees a turn prefilled on D: D keeps what the next turn needs. Where the
        # next turn may be prefilled on D by the cost model alone (its caller can, and the policy
        # weighs no history against the new tokens), D's KV could spare the next turn P
        # altogether: D keeps it. With that weighing (`min_history_per_new_token`), a P that
        # keeps the prompt lacks only the output, and the next turn goes through P unless it adds
        # fewer tokens than that: retention then follows the pull's rule, as for any caller.
        local_rule = self.policy.config.prefill_on_decode
        on_decode_next = (
            turn.prefill_on_decode_ok
            and local_rule.max_new_tokens > 0
            and local_rule.min_history_per_new_token == 0
        )
        keeps = (
            receipt is not None
            and not on_decode_next
            and self._prefill_record.keeps_until_next_turn(plan.prefill, receipt, turn.prompt.tokens)
        )
        skip_retention = not decode_retention_pays(
            keeps, turn.max_output_tokens, plan.decode.kv_bytes_per_token, self.costs, self.policy.config.pull
        )
        return RouteOutcome(
            route_id,
            plan,
            decision,
            reason,
            params,
            reused,
            handle,
            handle_pb=checked.handle_pb if checked is not None else b"",
            routed_unix_ms=snapshot.now_unix_ms,
            skip_decode_retention=skip_retention,
            superseded=record if skip_retention and record is not None and checked is None else None,
        )

    async def _snapshot(
        self, turn: TurnRequest
    ) -> tuple[RouteSnapshot, HandleRecord | None, tuple[NodeState, ...], float | None]:
        """The policy's input, the handle it saw, every known node, and what is left of the budget."""
        cluster = self.cluster
        key = (turn.tenant, turn.conversation)
        record = cluster.handle(turn.tenant, turn.conversation)
        all_states = cluster.node_states()
        if all_states and not any(st.node.fingerprint.model == turn.model for st in all_states):
            # Nodes are known, none serves this model: the request's own error, not an outage.
            raise NotFound(f"model {turn.model!r} is not served by any node")
        prompt = self._chains.with_chain(key, turn.prompt, self._digest_block_size(record, all_states))
        recorded = self._prefill_record.cached_tokens(
            key, prompt.tokens, prompt.block_digests, prompt.digest_block_size
        )
        prefill_cached, seen = self._engine_views(recorded, all_states, turn)
        known_nodes = frozenset(
            node_id
            for node_id in prefill_cached
            if node_id in seen or self._prefill_record.shows_keeping(node_id)
        )
        time_budget_s = turn.time_budget_s
        awaited = turn.awaited
        if awaited is not None and (record is None or record.handle.handle_id != awaited.handle_id):
            started = self.clock.monotonic_s()
            # Only what P is known to hold spares the wait: its events, or a record its reports
            # have shown right. A guess that P holds the history, wrong, costs the history's
            # recompute; waiting for the announced handle costs its publish, milliseconds.
            known = {node_id: tokens for node_id, tokens in prefill_cached.items() if node_id in known_nodes}
            waited = await self._await_publish(
                key, awaited, prompt, known, all_states, time_budget_s, turn.prefill_on_decode_ok
            )
            record = waited or record
            if time_budget_s is not None:
                time_budget_s -= self.clock.monotonic_s() - started
            all_states = cluster.node_states()
        now = self.clock.unix_ms()
        if cluster.healthy:
            self._view_live_ms = now
        states = usable_nodes(all_states, cluster.suspects, turn.failed_node_ids)
        snapshot = RouteSnapshot(
            model=turn.model,
            conversation=turn.conversation,
            prompt=prompt,
            nodes=self._inflight.current(states, now, costs=self.costs),
            now_unix_ms=now,
            handle=record.handle if record is not None else None,
            last_prefill_node_id=self._book.last_prefill(key),
            prefill_homes=self._book.homes(self.clock.monotonic_s(), key),
            prefill_routed_order=self._book.routed_order(),
            last_decode_node_id=self._book.last_decode(key),
            contacted=self._book.contacted,
            loads_as_of_unix_ms=now if cluster.healthy else self._loads_as_of(),
            prefill_cached_tokens=prefill_cached,
            prefill_cache_known=known_nodes,
            decode_cached_tokens=self._decode_views(states, turn),
            tie_salt=self.tie_salt,
            prefill_on_decode_ok=turn.prefill_on_decode_ok,
        )
        return snapshot, record, all_states, time_budget_s

    def _engine_views(
        self, recorded: Mapping[str, int], states: tuple[NodeState, ...], turn: TurnRequest
    ) -> tuple[Mapping[str, int], frozenset[str]]:
        """The record's guess of each prefill node's cache, replaced where its engine's events
        are fresh by the exact prefix they show (`state.engine_caches`); and the nodes whose
        events did."""
        caches = self.engine_caches
        if caches is None or not len(caches):
            return recorded, frozenset()
        nodes = [(s.node.node_id, s.node.incarnation) for s in states if s.node.role.can_prefill()]
        key = (turn.tenant, turn.conversation)
        seen = caches.prefix_tokens(nodes, turn.prompt, turn.cache_salt, self.clock.monotonic_s(), key)
        if not seen:
            return recorded, frozenset()
        merged = dict(recorded)
        for node_id, tokens in seen.items():
            if tokens > 0:
                merged[node_id] = tokens
            else:
                merged.pop(node_id, None)
        return merged, frozenset(seen)

    def _decode_views(self, states: tuple[NodeState, ...], turn: TurnRequest) -> Mapping[str, int]:
        """The prefix of the prompt each decode node's own cache holds where its engine's events
        are fresh (none held: left out): where D may prefill the turn from its own cache."""
        rule = self.policy.config.prefill_on_decode
        if not (turn.prefill_on_decode_ok and rule.from_decode_cache and rule.max_new_tokens > 0):
            return {}  # no plan could use them: Route does not hash for them
        caches = self.engine_caches
        if caches is None or not len(caches):
            return {}
        nodes = [(s.node.node_id, s.node.incarnation) for s in states if s.node.role.can_decode()]
        if not nodes:
            return {}
        key = (turn.tenant, turn.conversation)
        seen = caches.prefix_tokens(nodes, turn.prompt, turn.cache_salt, self.clock.monotonic_s(), key)
        return {node_id: tokens for node_id, tokens in seen.items() if tokens > 0}

    def _plan(self, snapshot: RouteSnapshot, all_states: tuple[NodeState, ...]) -> RoutePlan:
        """The policy's plan over the usable nodes, else over every known node."""
        try:
            return self.policy.route(snapshot, self.costs)
        except NoEligibleNodes as exc:
            if len(snapshot.nodes) == len(all_states):
                raise NoRoute(str(exc)) from None
        # Only failed or suspect nodes could serve the turn: trying one beats failing it.
        nodes = self._inflight.current(all_states, snapshot.now_unix_ms, costs=self.costs)
        try:
            return self.policy.route(replace(snapshot, nodes=nodes), self.costs)
        except NoEligibleNodes as again:
            raise NoRoute(str(again)) from None

    async def _await_publish(
        self,
        key: tuple[str, str],
        awaited: AwaitedHandle,
        prompt: Prompt,
        prefill_cached: Mapping[str, int],
        all_states: tuple[NodeState, ...],
        time_budget_s: float | None,
        prefill_on_decode_ok: bool,
    ) -> HandleRecord | None:
        """The awaited handle once the cluster view holds it, or None; waits only when it pays.

        D's connector publishes its handle as the turn ends, asynchronously, and a caller may
        send the next turn at once: routed before the publish lands, the turn would find no
        handle. Nothing holds the turn for the previous turn's report; only a turn that needs
        the handle waits for it, bounded by `publish_wait_s` and the caller's deadline. A
        prefill node known to hold the history already (its prefix cache, as its events show it
        or as its reports have proven the record) needs no pull, so then the turn goes on at once,
        unless the handle could let its holder prefill the turn itself (for a caller that can run
        a turn on D alone), which spares the turn P's leg and the hand-off, not only a pull.
        """
        held = max(prefill_cached.values(), default=0)
        wanted = min(awaited.tokens, prompt.tokens - 1) if awaited.tokens > 0 else prompt.tokens - 1
        decodes = [s for s in all_states if s.node.role.can_decode()]
        holder_bytes = max((s.node.kv_bytes_per_token for s in decodes), default=0)
        # What P lacks (the last answer, say) may be cheaper to recompute than to pull, and the
        # turn may add more than D would prefill: then the handle would not be used, and waiting
        # for it would only delay the turn.
        if not pull_could_pay(wanted - held, holder_bytes, self.costs, self.policy.config.pull) and not (
            prefill_on_decode_ok
            and handle_could_serve_on_decode(
                wanted,
                prompt.tokens,
                held,
                # Each decode node's load as routing counts it: the report and the turns routed
                # since; counted only where the idle waiver decides.
                lambda: self._inflight.current(decodes, self.clock.unix_ms(), costs=self.costs),
                self.policy.config.prefill_on_decode,
            )
        ):
            return None
        wait_s = self.settings.publish_wait_s
        if time_budget_s is not None:
            # Leave the check-out and the answer their share of the caller's deadline.
            wait_s = min(wait_s, time_budget_s / 2)
        if wait_s <= 0:
            return None
        tenant, conversation = key
        landed = await self.cluster.await_handle(tenant, conversation, awaited.handle_id, wait_s)
        return self.cluster.handle(tenant, conversation) if landed else None

    async def _check_out(
        self, turn: TurnRequest, route_id: str, record: HandleRecord, time_budget_s: float | None
    ) -> tuple[CheckOut | None, str, HandleRecord | None]:
        """The check-out, or None with the reason the handle could not be checked out, and the
        handle the conversation retains instead when that is why (HandleReplaced)."""
        if not self.cluster.healthy:
            # A stale view may still hold a handle that is gone; without etcd the
            # check-out cannot be made, so this turn recomputes.
            return None, "etcd unreachable: recomputing from the cached view", None
        timeout_s = self.settings.checkout_timeout_s
        if time_budget_s is not None:
            # Keep a little of the caller's deadline to send the answer.
            timeout_s = min(timeout_s, time_budget_s - _ANSWER_MARGIN_S)
            if timeout_s <= 0:
                return None, "caller's deadline too short to check the handle out", None
        try:
            checked = await self.checkout.check_out(
                turn.tenant, turn.conversation, route_id, record, timeout_s
            )
        except HandleReplaced as exc:
            return None, "the conversation retains a newer handle than this replica saw", exc.current
        except (HandleNotRetained, NotFound):
            return None, "another turn of the conversation took the handle", None
        except (StoreUnavailable, TimeoutError) as exc:
            # A timed-out check-out may still apply: then nobody reads the blocks
            # and D frees them at its TTL. Never a double read.
            log.warning("check-out failed, recomputing: %s", exc)
            return None, "etcd unreachable: recomputing", None
        return checked, f"checked out handle {checked.handle.handle_id}", None

    # -- account ------------------------------------------------------------------------------

    def _account(
        self, route_id: str, key: tuple[str, str], snapshot: RouteSnapshot, plan: RoutePlan, pulled: bool
    ) -> SentReceipt | None:
        """Records the route's work on its nodes, and what P's prefix cache will hold (None: the
        turn reaches no prefill node, as when D prefills it itself)."""
        self._inflight.add(
            *routed_work(
                route_id,
                snapshot,
                plan,
                self.costs,
                pulled=pulled,
                send_delay_ms=self.settings.send_delay_ms,
                decode_after_prefill=self.settings.decode_after_prefill,
            )
        )
        if plan.decision is Decision.PREFILL_ON_DECODE:
            return None
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

    def _loads_as_of(self) -> int:
        """While etcd is unreachable: when the view was last known to be live."""
        return max(self._view_live_ms, self.cluster.newest_report_unix_ms())

    # -- learn --------------------------------------------------------------------------------

    def report(self, route_id: str, tenant: str, conversation: str, report: TurnReport) -> RouteRecord | None:
        """A turn is over: its work leaves the ledger, and the report teaches the cost model.

        Only turns this router routed teach it, once each, so made-up reports cannot steer it.
        Returns the route's record (None: not routed here, or reported already).
        """
        route = self._book.reported(route_id) if route_id else None
        if route is None:
            return None
        # The turn is over: its work has left P's queue and D's batch (where a report D took
        # before its answer ended still counts it as running, until a later one). A report held
        # back to ride on a later call arrives late: only the caller's time of the end says which
        # of D's reports came before it (not after now: a caller's clock ahead of this one's).
        ended = report.ended_unix_ms
        self._inflight.finished(
            route_id,
            decode_node_id=route.decode_node_id if ended is not None else "",
            ended_unix_ms=min(ended, self.clock.unix_ms()) if ended is not None else None,
        )
        if (route.tenant, route.conversation) == (tenant, conversation):
            self._learn(report, route)
        return route

    def _learn(self, report: TurnReport, route: RouteRecord) -> None:
        if route.decision is Decision.PREFILL_ON_DECODE:
            # D's compute, between its decode steps: not what the cost model fits (P's prefills).
            return
        # P's own measure of its wait where it gave one: routing's estimate is off by as much as
        # P's queue is long, and would teach the fit that error as compute.
        measured = report.prefill_queued_ms
        observation = TurnObservation(
            prompt_tokens=report.prompt_tokens,
            pulled_tokens=report.pulled_tokens,
            cached_tokens=report.cached_tokens or 0,
            transfer_ms=max(0.0, report.transfer_ms),
            prefill_ms=max(0.0, report.prefill_ms),
            ttft_ms=max(0.0, report.ttft_ms),
            kv_bytes_per_token=route.kv_bytes_per_token,
            success=report.success,
            first_contact=route.first_contact,
            queued_ms=route.queued_ms if measured is None else max(0.0, measured),
            queued_measured=measured is not None,
        )
        self.costs = self.costs.observe(observation)
        prefill: Node | None = self.cluster.node(route.prefill_node_id)
        if report.success and report.cached_tokens is not None and route.receipt and prefill:
            # What P found in its own cache corrects what this router believes it holds, at once.
            self._prefill_record.observed(prefill, route.receipt, report.cached_tokens, prefill.block_size)

    def forget(self, tenant: str, conversation: str) -> None:
        """The conversation ended: nothing of it is kept."""
        key = (tenant, conversation)
        self._book.forget(key)
        self._prefill_record.forget(key)
        self._chains.forget(key)
        if self.engine_caches is not None:
            self.engine_caches.forget_conversation(key)


def _queued_ms(snapshot: RouteSnapshot, node_id: str, costs: CostModel) -> float:
    """The wait the snapshot shows on `node_id` ahead of a new turn (ms)."""
    state = next((s for s in snapshot.nodes if s.node.node_id == node_id), None)
    return costs.queue_ms(state) if state is not None else 0.0
