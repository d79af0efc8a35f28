"""Work a router has sent to nodes that their load reports do not show yet.

A node reports its load when it changes, at most every half second (and an
unchanged one every ten); turns that arrive together between two reports
would all see the same idle node and pile onto it. The
ledger remembers what this router sent each node since (prompt tokens to
compute on a prefill node, KV blocks and a running request on a decode
node), adds it to the node's last report, and forgets it once a report taken
after the work became visible on the node covers it, once the turn is
reported finished, or after `max_age_ms` (a node that stopped reporting is
judged by the `live` filter, not by guesses piled up here).

The other way round, a turn reported finished has left its decode node, but a
report taken before it ended still counts its request as running there: until a
later report, the ledger takes it out (`finished` with the decode node and the
time). A conversation's next turn is often routed milliseconds after its answer
ended, and should find its D without that answer.

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

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush
from itertools import count

from kvplane.services.common.model.nodes import NodeLoad, tokens_left
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


@dataclass(slots=True)
class _NodeQueue:
    """One node's routed work folded over its last report, kept between calls.

    Valid while the node's report and the prices are unchanged and no work has
    left the node (a removal drops it); work routed since is folded in as it comes. The FIFO's
    stretches are in time order: each starts once the one before has finished.
    """

    load: NodeLoad
    prices: tuple[float, float, float] | None
    # How many of the node's pending items are folded in (items are kept in routing order).
    count: int
    # Sums over the folded items.
    tokens: int
    blocks: int
    queued: int
    running: int
    # The earliest routing time among them, or a lower bound of it once work has left. Aged-out
    # work is taken out of a fold without a FIFO (`_shed`); in a FIFO's it forces a refold.
    first_routed_ms: float
    finish: float
    # The stretches, the report's queue first: starts, ends, and prefix sums of their tokens.
    starts: list[float]
    ends: list[float]
    token_sums: list[int]
    # Work routed to the node since, in routing order, not folded in yet.
    unfolded: list[RoutedWork] = field(default_factory=list)
    # Without a FIFO (no prices): the folded items by routing time, (time, order folded, item),
    # so that aged-out work can be taken out; an item that left the node since stays until popped.
    by_age: list[tuple[int, int, RoutedWork]] | None = None

    def unfold(self, item: RoutedWork) -> bool:
        """Takes a folded item back out, when the fold allows it exactly: only sums, no FIFO stretch."""
        if self.prices is not None or item.prefill_tokens or item.prefill_ms > 0:
            return False
        self.count -= 1
        self.blocks -= item.kv_blocks
        self.queued -= item.queued_requests
        self.running -= item.running_requests
        return True

    def queued_tokens(self, now: float) -> int:
        """The tokens not yet computed at `now`: part of the stretch running then, all of the later ones."""
        i = bisect_right(self.ends, now)
        if i == len(self.ends):
            return 0
        this = self.token_sums[i + 1] - self.token_sums[i]
        later = self.token_sums[-1] - self.token_sums[i + 1]
        return round(tokens_left(now, self.starts[i], self.ends[i], this) + later)


class InFlightLedger:
    """Routed work per node, not yet in its load reports. Not thread-safe: one event loop.

    `current` is called on every route, for every candidate node; a node's
    pending work is folded over its report once (`_NodeQueue`) and extended as
    work is routed, so a route costs the same however many turns are in flight.
    Work that leaves a node without a FIFO (a decode node: its fold is sums), by
    finishing or by age, is taken out of the fold; a prefill node is refolded.
    """

    def __init__(self, *, max_age_ms: int = 30_000, limit: int = 100_000) -> None:
        if max_age_ms <= 0 or limit <= 0:
            raise ValueError("max_age_ms and limit must be positive")
        self.max_age_ms = max_age_ms
        self.limit = limit
        # route id -> its work items, oldest route first (the bound drops from the front).
        self._routes: OrderedDict[str, tuple[RoutedWork, ...]] = OrderedDict()
        self._by_node: dict[str, dict[str, RoutedWork]] = {}
        # Per node: its fold, dropped whenever work leaves the node.
        self._queues: dict[str, _NodeQueue] = {}
        # Per decode node: requests that ended there, each as (from when a report counts it, when
        # it ended), in the order their turns were reported.
        self._departed: dict[str, list[tuple[int, int]]] = {}
        self._finishes = 0

    def __len__(self) -> int:
        return len(self._routes)

    def departures(self, node_id: str) -> int:
        """Requests remembered as ended on `node_id`: kept until a report covers them, or they
        age out (swept every `_SWEEP_EVERY` finishes, so a node gone from the fleet keeps none)."""
        return len(self._departed.get(node_id, ()))

    def add(self, *work: RoutedWork) -> None:
        """Records a route's work (one item per node it was sent to)."""
        if not work:
            return
        route_id = work[0].route_id
        self.finished(route_id)
        self._routes[route_id] = work
        for item in work:
            self._by_node.setdefault(item.node_id, {})[route_id] = item
            queue = self._queues.get(item.node_id)
            if queue is not None:
                queue.unfolded.append(item)
        while len(self._routes) > self.limit:
            oldest = next(iter(self._routes))
            self.finished(oldest)

    def finished(self, route_id: str, *, decode_node_id: str = "", ended_unix_ms: int | None = None) -> None:
        """The turn is over: its work has left every node's queue. With `decode_node_id` and
        `ended_unix_ms`: its request ended then on that decode node, where a report taken before
        then counts it as running unless the ledger still held it (no report had shown it)."""
        work = self._routes.pop(route_id, ())
        for item in work:
            self._drop(item.node_id, route_id)
        if decode_node_id and ended_unix_ms is not None:
            # A report taken after the request reached the node and before it ended counts it.
            # Work no longer held was covered by a report already (or aged out): any counts it.
            visible = next(
                (i.visible_unix_ms for i in work if i.node_id == decode_node_id and i.running_requests), 0
            )
            self._departed.setdefault(decode_node_id, []).append((visible, ended_unix_ms))
            self._finishes += 1
            if self._finishes % _SWEEP_EVERY == 0:
                # Nodes no route asks about any more (gone from the fleet) keep nothing for long.
                self._sweep(ended_unix_ms - self.max_age_ms)

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
            node_id = state.node.node_id
            pending = self._by_node.get(node_id)
            load = state.load
            # Only a prefill node's queue is drained and priced.
            prefill = costs if state.node.role.can_prefill() else None
            if load is not None and node_id in self._departed:
                gone = self._gone(node_id, load.reported_unix_ms, oldest)
                if gone:
                    load = replace(load, running_requests=max(0, load.running_requests - gone))
                    state = NodeState(state.node, load, state.queued_prefill_ms)
            idle = prefill is None or not (
                load is None or load.queued_prefill_tokens or load.queued_requests or load.running_requests
            )
            if load is None or (not pending and idle):
                out.append(state)
                continue
            queue = self._queue(node_id, load, prefill, pending or {}, oldest)
            if not queue.count and idle:
                # Every item was covered or aged out just now: as if there had been none.
                out.append(state)
                continue
            queued_tokens = load.queued_prefill_tokens + queue.tokens
            queued_ms: float | None = None
            if prefill is not None:
                queued_ms = max(0.0, queue.finish - now_unix_ms)
                queued_tokens = queue.queued_tokens(now_unix_ms)
            changed = (
                queued_tokens != load.queued_prefill_tokens or queue.blocks or queue.queued or queue.running
            )
            if changed or queued_ms is not None:
                load = replace(
                    load,
                    queued_prefill_tokens=queued_tokens,
                    queued_requests=load.queued_requests + queue.queued,
                    running_requests=load.running_requests + queue.running,
                    free_kv_blocks=max(0, load.free_kv_blocks - queue.blocks),
                )
                state = NodeState(state.node, load, queued_ms)
            out.append(state)
        return tuple(out)

    def _sweep(self, oldest: int) -> None:
        """Forgets every node's departures older than the age limit."""
        for node_id in list(self._departed):
            kept = [(v, e) for v, e in self._departed[node_id] if e >= oldest]
            if kept:
                self._departed[node_id] = kept
            else:
                del self._departed[node_id]

    def _gone(self, node_id: str, reported_unix_ms: int, oldest: int) -> int:
        """How many requests the node's report counts as running that ended after it was taken;
        forgets those a later report covers, and those older than the age limit."""
        kept = [(v, e) for v, e in self._departed[node_id] if e > reported_unix_ms and e >= oldest]
        if kept:
            self._departed[node_id] = kept
        else:
            del self._departed[node_id]
        return sum(1 for visible, _ in kept if visible < reported_unix_ms)

    def _queue(
        self,
        node_id: str,
        load: NodeLoad,
        prefill: CostModel | None,
        pending: dict[str, RoutedWork],
        oldest: int,
    ) -> _NodeQueue:
        """The node's work folded over `load`: the kept fold, extended by work routed since, or a new one."""
        prices = (
            None
            if prefill is None
            else (prefill.prefill_fixed_ms, prefill.recompute_ms_per_token, prefill.reused_ms_per_token)
        )
        queue = self._queues.get(node_id)
        if queue is not None and queue.first_routed_ms < oldest:
            self._shed(node_id, queue, pending, oldest)
        if (
            queue is not None
            and queue.prices == prices
            and queue.first_routed_ms >= oldest
            and queue.count + len(queue.unfolded) == len(pending)
            and queue.load == load
        ):
            fresh, queue.unfolded = queue.unfolded, []
            reported = load.reported_unix_ms
            if all(item.visible_unix_ms >= reported and item.routed_unix_ms >= oldest for item in fresh):
                for item in fresh:
                    _fold(queue, item, prefill)
                return queue
        queue = self._refold(node_id, load, prefill, prices, pending, oldest)
        self._queues[node_id] = queue
        return queue

    def _refold(
        self,
        node_id: str,
        load: NodeLoad,
        prefill: CostModel | None,
        prices: tuple[float, float, float] | None,
        pending: dict[str, RoutedWork],
        oldest: int,
    ) -> _NodeQueue:
        """Forgets the node's covered and aged-out work, and folds the rest over `load`."""
        reported = load.reported_unix_ms
        # Only a report taken after the work reached the node shows it: one taken in the same
        # millisecond may have been read before the work was routed.
        done = [
            route_id
            for route_id, item in pending.items()
            if item.visible_unix_ms < reported or item.routed_unix_ms < oldest
        ]
        for route_id in done:
            self._forget(route_id, node_id)
        finish = reported + (prefill.reported_queue_ms(load) if prefill is not None else 0.0)
        queue = _NodeQueue(
            load=load,
            prices=prices,
            count=0,
            tokens=0,
            blocks=0,
            queued=0,
            running=0,
            first_routed_ms=float("inf"),
            finish=finish,
            starts=[float(reported)],
            ends=[finish],
            token_sums=[0, load.queued_prefill_tokens],
            by_age=[] if prices is None else None,
        )
        for item in self._by_node.get(node_id, {}).values():
            _fold(queue, item, prefill)
        return queue

    def _shed(self, node_id: str, queue: _NodeQueue, pending: dict[str, RoutedWork], oldest: int) -> None:
        """Takes aged-out work out of a fold without a FIFO, oldest first, so that work ageing
        out one turn at a time does not refold the node on every route. Stops at the first
        item it cannot take out; a refold then sees to the rest."""
        heap = queue.by_age
        if heap is None:
            return
        first = float("inf")
        while heap:
            routed, _, item = heap[0]
            if pending.get(item.route_id) is not item:
                heappop(heap)  # it left the node already
                continue
            if routed >= oldest or not queue.unfold(item):
                first = routed
                break
            heappop(heap)
            del pending[item.route_id]
            self._forget_share(item.route_id, node_id)
        queue.first_routed_ms = first
        if not pending and self._by_node.get(node_id) is pending:
            del self._by_node[node_id]

    def _forget(self, route_id: str, node_id: str) -> None:
        """Drops one node's share of a route; the route goes when no node has any left."""
        self._drop(node_id, route_id)
        self._forget_share(route_id, node_id)

    def _forget_share(self, route_id: str, node_id: str) -> None:
        work = self._routes.get(route_id)
        if work is not None:
            left = tuple(item for item in work if item.node_id != node_id)
            if left:
                self._routes[route_id] = left
            else:
                del self._routes[route_id]

    def _drop(self, node_id: str, route_id: str) -> None:
        pending = self._by_node.get(node_id)
        item = pending.pop(route_id, None) if pending is not None else None
        if pending is None or item is None:
            return
        queue = self._queues.get(node_id)
        if queue is not None and not _take_out(queue, item):
            del self._queues[node_id]
        if not pending:
            del self._by_node[node_id]


# Reported finishes between two sweeps of the departures of every node.
_SWEEP_EVERY = 1024

# Numbers folded items in order, so that equal routing times never compare the items themselves.
_FOLDED = count()


def _take_out(queue: _NodeQueue, item: RoutedWork) -> bool:
    """Removes work that left the node from its fold; False when only a refold can."""
    for i, waiting in enumerate(queue.unfolded):
        if waiting is item:
            del queue.unfolded[i]
            return True
    # Its routing time may have been the earliest: a lower bound is kept, `_shed` finds the real one.
    return queue.unfold(item)


def _fold(queue: _NodeQueue, item: RoutedWork, prefill: CostModel | None) -> None:
    """Adds one item of routed work to the end of the node's FIFO."""
    queue.count += 1
    queue.tokens += item.prefill_tokens
    queue.blocks += item.kv_blocks
    queue.queued += item.queued_requests
    queue.running += item.running_requests
    queue.first_routed_ms = min(queue.first_routed_ms, item.routed_unix_ms)
    if queue.by_age is not None:
        heappush(queue.by_age, (item.routed_unix_ms, next(_FOLDED), item))
    if item.prefill_ms > 0 or item.prefill_tokens:
        start = max(queue.finish, float(item.routed_unix_ms))
        spent = item.prefill_ms
        if not spent and prefill is not None:
            spent = prefill.prefill_ms(item.prefill_tokens)
        queue.finish = start + spent
        queue.starts.append(start)
        queue.ends.append(queue.finish)
        queue.token_sums.append(queue.token_sums[-1] + item.prefill_tokens)


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
