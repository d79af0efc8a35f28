"""Work a router has sent to nodes that their load reports do not show yet.

A node reports its load every half second or so; turns that arrive together
between two reports would all see the same idle node and pile onto it. The
ledger remembers what this router sent each node since (prompt tokens to
compute on a prefill node, KV blocks and a running request on a decode
node), adds it to the node's last report, and forgets it once a report taken
after the work became visible on the node covers it, once the turn is
reported finished, or after `max_age_ms` (a node that stopped reporting is
judged by the `live` filter, not by guesses piled up here).

A report is also old by the time it is read: given the cost model, the
ledger drains the reported queue and the work routed since as a FIFO prefill
node would have, so the queue a turn sees is the one it would join now. Each
routed turn counts for its whole estimated prefill (`CostModel.prefill_ms`:
its fixed cost, its computed tokens, the tokens it reuses), and each request
in the report for its fixed cost too: a burst of small turns is mostly fixed
costs, which a count of tokens alone would not show.

Pure bookkeeping: no I/O, no clock reads; time is an argument. The routing
service and the simulator's `PolicyRouter` both keep one, so the policy sees
the same kind of current load in both. Each routing replica counts only its
own routes; the picker's tie-break is salted per replica, so replicas that
cannot see each other's routes still spread over equal nodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import RoutePlan
from kvplane.services.routing.policy.snapshot import NodeState, RouteSnapshot


@dataclass(frozen=True, slots=True)
class RoutedWork:
    """One turn's share of a node's load, until a report covers it.

    `visible_unix_ms`: from when the node itself counts the work (a report
    taken after it covers it).
    """

    route_id: str
    node_id: str
    visible_unix_ms: int
    routed_unix_ms: int
    prefill_tokens: int = 0
    # The prefill's estimated time on the node (ms); 0 on a decode-only share.
    prefill_ms: float = 0.0
    kv_blocks: int = 0
    queued_requests: int = 0
    running_requests: int = 0


class InFlightLedger:
    """Routed work per node, not yet in its load reports. Not thread-safe: one event loop."""

    def __init__(self, *, max_age_ms: int = 30_000, limit: int = 100_000) -> None:
        if max_age_ms <= 0 or limit <= 0:
            raise ValueError("max_age_ms and limit must be positive")
        self.max_age_ms = max_age_ms
        self.limit = limit
        # route id -> its work items, oldest route first (the bound drops from the front).
        self._routes: OrderedDict[str, tuple[RoutedWork, ...]] = OrderedDict()
        self._by_node: dict[str, dict[str, RoutedWork]] = {}

    def __len__(self) -> int:
        return len(self._routes)

    def add(self, *work: RoutedWork) -> None:
        """Records a route's work (one item per node it was sent to)."""
        if not work:
            return
        route_id = work[0].route_id
        self.finished(route_id)
        self._routes[route_id] = work
        for item in work:
            self._by_node.setdefault(item.node_id, {})[route_id] = item
        while len(self._routes) > self.limit:
            oldest = next(iter(self._routes))
            self.finished(oldest)

    def finished(self, route_id: str) -> None:
        """The turn is over: its work has left every node's queue."""
        for item in self._routes.pop(route_id, ()):
            pending = self._by_node.get(item.node_id)
            if pending is not None:
                pending.pop(route_id, None)
                if not pending:
                    del self._by_node[item.node_id]

    def current(
        self,
        states: Iterable[NodeState],
        now_unix_ms: int,
        *,
        costs: CostModel | None = None,
        prefill_ms_per_token: float = 0.0,
    ) -> tuple[NodeState, ...]:
        """`states` with the work each report does not cover yet added to it.

        With `costs`, a prefill node's queue (`NodeState.queued_prefill_ms`, and
        its tokens) is the reported one and the routed work, drained since as a
        FIFO node computes them; work recorded without a time is priced by
        `costs`. `prefill_ms_per_token` alone prices by tokens only (no fixed
        cost), for a caller that knows only a rate. Covered and aged-out work is
        forgotten on the way. A node that has not reported keeps no load: the
        policy treats an unknown load as unknown.
        """
        if costs is None and prefill_ms_per_token > 0:
            costs = CostModel(
                prefill_fixed_ms=0.0, recompute_ms_per_token=prefill_ms_per_token, reused_ms_per_token=0.0
            )
        out: list[NodeState] = []
        oldest = now_unix_ms - self.max_age_ms
        for state in states:
            pending = self._by_node.get(state.node.node_id)
            load = state.load
            # Only a prefill node's queue is drained and priced.
            prefill = costs if state.node.role.can_prefill() else None
            if load is None or (
                not pending
                and (
                    prefill is None
                    or not (load.queued_prefill_tokens or load.queued_requests or load.running_requests)
                )
            ):
                out.append(state)
                continue
            reported = load.reported_unix_ms
            tokens = blocks = queued = running = 0
            # Each stretch of the FIFO: (start, end, tokens), the report's queue first.
            finish = reported + (prefill.reported_queue_ms(load) if prefill is not None else 0.0)
            stretches = [(float(reported), finish, load.queued_prefill_tokens)]
            done: list[str] = []
            for route_id, item in (pending or {}).items():
                # Only a report taken after the work reached the node shows it: one taken in the
                # same millisecond may have been read before the work was routed.
                if item.visible_unix_ms < reported or item.routed_unix_ms < oldest:
                    done.append(route_id)
                    continue
                tokens += item.prefill_tokens
                blocks += item.kv_blocks
                queued += item.queued_requests
                running += item.running_requests
                if item.prefill_ms > 0 or item.prefill_tokens:
                    start = max(finish, float(item.routed_unix_ms))
                    spent = item.prefill_ms
                    if not spent and prefill is not None:
                        spent = prefill.prefill_ms(item.prefill_tokens)
                    finish = start + spent
                    stretches.append((start, finish, item.prefill_tokens))
            for route_id in done:
                self._forget(route_id, state.node.node_id)
            queued_tokens = load.queued_prefill_tokens + tokens
            queued_ms: float | None = None
            if prefill is not None:
                queued_ms = max(0.0, finish - now_unix_ms)
                queued_tokens = round(sum(_left(now_unix_ms, *stretch) for stretch in stretches))
            changed = queued_tokens != load.queued_prefill_tokens or blocks or queued or running
            if changed or queued_ms is not None:
                load = replace(
                    load,
                    queued_prefill_tokens=queued_tokens,
                    queued_requests=load.queued_requests + queued,
                    running_requests=load.running_requests + running,
                    free_kv_blocks=max(0, load.free_kv_blocks - blocks),
                )
                state = NodeState(state.node, load, queued_ms)
            out.append(state)
        return tuple(out)

    def _forget(self, route_id: str, node_id: str) -> None:
        """Drops one node's share of a route; the route goes when no node has any left."""
        pending = self._by_node.get(node_id)
        if pending is not None:
            pending.pop(route_id, None)
            if not pending:
                del self._by_node[node_id]
        work = self._routes.get(route_id)
        if work is not None:
            left = tuple(item for item in work if item.node_id != node_id)
            if left:
                self._routes[route_id] = left
            else:
                del self._routes[route_id]


def _left(now: float, start: float, end: float, tokens: int) -> float:
    """The tokens of a FIFO stretch not yet computed at `now` (computed evenly from start to end)."""
    if end <= now:
        return 0.0
    if start >= now or end <= start:
        return float(tokens)
    return tokens * (end - now) / (end - start)


def turn_work(
    route_id: str,
    *,
    routed_unix_ms: int,
    prefill_node_id: str,
    prefill_tokens: int,
    prefill_visible_unix_ms: int,
    decode_node_id: str,
    decode_kv_blocks: int,
    decode_visible_unix_ms: int,
    prefill_ms: float = 0.0,
) -> tuple[RoutedWork, ...]:
    """One turn's work: a prefill queued on P (`prefill_ms` of it, estimated), then a
    running request and its KV on D.

    A node serving both legs gets one item holding both, visible from the
    earlier time.
    """
    prefill = RoutedWork(
        route_id,
        prefill_node_id,
        prefill_visible_unix_ms,
        routed_unix_ms,
        prefill_tokens=max(0, prefill_tokens),
        prefill_ms=max(0.0, prefill_ms),
        queued_requests=1,
    )
    decode = RoutedWork(
        route_id,
        decode_node_id,
        decode_visible_unix_ms,
        routed_unix_ms,
        kv_blocks=max(0, decode_kv_blocks),
        running_requests=1,
    )
    if prefill_node_id == decode_node_id:
        both = replace(
            prefill,
            visible_unix_ms=min(prefill_visible_unix_ms, decode_visible_unix_ms),
            kv_blocks=decode.kv_blocks,
            running_requests=1,
        )
        return (both,)
    return (prefill, decode)


def routed_work(
    route_id: str,
    snapshot: RouteSnapshot,
    plan: RoutePlan,
    costs: CostModel,
    *,
    pulled: bool,
    send_delay_ms: int,
    decode_after_prefill: bool,
) -> tuple[RoutedWork, ...]:
    """The work a planned turn adds to its nodes (`snapshot.now_unix_ms` is when it was routed).

    P computes the prompt less what its cache holds and what the pull (if the
    handle was checked out: `pulled`) brings, and pays the prefill's fixed cost
    and the reused tokens' share once (`CostModel.prefill_ms`); the transfer
    is not P's compute, so it queues nothing behind it. D holds the prompt's KV once it
    admits the turn: at once, or (`decode_after_prefill`, as with vLLM, where
    D gets the turn from P) once P is expected to be done with it.
    """
    now = snapshot.now_unix_ms
    prompt = snapshot.prompt
    verdict = plan.verdict
    covered = max(verdict.cached_tokens, verdict.reusable_tokens if pulled else 0)
    compute = max(1, prompt.tokens - covered)
    prefill_ms = costs.prefill_ms(compute, covered)
    visible = now + send_delay_ms
    decode_visible = visible
    if decode_after_prefill:
        state = next((s for s in snapshot.nodes if s.node.node_id == plan.prefill.node_id), None)
        expected_ms = costs.queue_ms(state) if state is not None else 0.0
        expected_ms += (verdict.transfer_ms if pulled else 0.0) + prefill_ms
        decode_visible += int(expected_ms)
    return turn_work(
        route_id,
        routed_unix_ms=now,
        prefill_node_id=plan.prefill.node_id,
        prefill_tokens=compute,
        prefill_visible_unix_ms=visible,
        decode_node_id=plan.decode.node_id,
        decode_kv_blocks=-(-prompt.tokens // max(1, plan.decode.block_size)),
        decode_visible_unix_ms=decode_visible,
        prefill_ms=prefill_ms,
    )
