"""What a router remembers of the routes it made: each route until its report, each
conversation's last prefill and decode nodes, and the engine pairs that have met.

A route's record lets its report teach the cost model (only turns this router
routed do, once each) and correct the prefill record. A first pull between a
prefill engine and a holder pays the NIXL handshake; later ones do not.

How many active conversations each prefill node served last (`homes`) is what a new
conversation's placement balances (policy/turn_cost.py): a conversation is active for
`active_s` after its last routed turn. Conversations long over are not load: counted, they
would send a run of new ones to whichever node served fewer of them.

Pure bookkeeping: no I/O, no clock reads (the caller says when). Bounded, least recently
written out: best effort.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from kvplane.services.common.runtime.bounded_map import BoundedMap
from kvplane.services.routing.policy import Decision
from kvplane.services.routing.state.prefill_record import SentReceipt


@dataclass(frozen=True, slots=True)
class RouteRecord:
    """What a turn's report needs to know about the route this router made."""

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


@dataclass(slots=True)
class _Last:
    """A conversation's last routed turn: its nodes, when (seconds), and whether it still counts
    among its prefill node's active homes."""

    prefill_node_id: str
    decode_node_id: str
    routed_s: float
    active: bool = True


class RouteBook:
    """Routes awaiting their reports, last prefill and decode nodes, and engine pairs that have met."""

    def __init__(self, *, max_routes: int, max_conversations: int, active_s: float = 60.0) -> None:
        self._routes: BoundedMap[str, RouteRecord] = BoundedMap(max_routes)
        self._last: BoundedMap[tuple[str, str], _Last] = BoundedMap(
            max_conversations, on_evict=lambda _key, last: self._leave(last)
        )
        self.active_s = active_s
        # (when routed, conversation) of every turn routed in the last `active_s`, oldest first;
        # a conversation routed again since is skipped when its older entry expires.
        self._recent: deque[tuple[float, tuple[str, str]]] = deque()
        # How many active conversations each prefill node served last (`RouteSnapshot.prefill_homes`).
        self._homes: Counter[str] = Counter()
        # Turns routed, and the ordinal of the last one each prefill node served
        # (`RouteSnapshot.prefill_routed_order`).
        self._turns = 0
        self._routed_order: dict[str, int] = {}
        # (prefill node id, holder engine id): asked for membership only (`RouteSnapshot.contacted`).
        self.contacted: BoundedMap[tuple[str, str], None] = BoundedMap(max_conversations)

    def last_prefill(self, conversation: tuple[str, str]) -> str:
        """The prefill node of the conversation's previous turn ("" if not remembered)."""
        last = self._last.get(conversation)
        return last.prefill_node_id if last else ""

    def last_decode(self, conversation: tuple[str, str]) -> str:
        """The decode node of the conversation's previous turn ("" if not remembered)."""
        last = self._last.get(conversation)
        return last.decode_node_id if last else ""

    def contact(self, prefill_node_id: str, holder_engine_id: str) -> bool:
        """Records that the two engines meet; True if it is their first time."""
        pair = (prefill_node_id, holder_engine_id)
        first = pair not in self.contacted
        self.contacted.put(pair, None)
        return first

    def routed(self, route_id: str, record: RouteRecord, now_s: float) -> None:
        key = (record.tenant, record.conversation)
        prefill_node_id = record.prefill_node_id
        if record.decision is Decision.PREFILL_ON_DECODE:
            # No prefill node served the turn: the last one that did still holds the history.
            prefill_node_id = self.last_prefill(key)
        previous = self._last.get(key)
        if previous is not None:
            self._leave(previous)
        self._last.put(key, _Last(prefill_node_id, record.decode_node_id, now_s))
        if prefill_node_id:
            self._homes[prefill_node_id] += 1
        if record.prefill_node_id and record.decision is not Decision.PREFILL_ON_DECODE:
            self._turns += 1
            self._routed_order[record.prefill_node_id] = self._turns
        self._recent.append((now_s, key))
        self._routes.put(route_id, record)
        self._expire(now_s)

    def homes(self, now_s: float, conversation: tuple[str, str]) -> Mapping[str, int]:
        """Per prefill node, the active conversations whose last turn it served, `conversation`
        not counted."""
        self._expire(now_s)
        last = self._last.get(conversation)
        if last is None or not last.active or not last.prefill_node_id:
            return self._homes
        others = dict(self._homes)
        others[last.prefill_node_id] -= 1
        return others

    def routed_order(self) -> Mapping[str, int]:
        """Per prefill node, the ordinal of the last turn routed to it (higher: more recent)."""
        return self._routed_order

    def _expire(self, now_s: float) -> None:
        recent = self._recent
        while recent and recent[0][0] <= now_s - self.active_s:
            routed_s, key = recent.popleft()
            last = self._last.get(key)
            if last is not None and last.routed_s == routed_s:
                self._leave(last)

    def _leave(self, last: _Last) -> None:
        """The conversation no longer counts among its prefill node's homes (if it did)."""
        node_id = last.prefill_node_id
        if last.active and node_id:
            self._homes[node_id] -= 1
            if self._homes[node_id] <= 0:
                del self._homes[node_id]
        last.active = False

    def reported(self, route_id: str) -> RouteRecord | None:
        """The route's record, once: a second report of it finds none."""
        return self._routes.pop(route_id)

    def forget(self, conversation: tuple[str, str]) -> None:
        last = self._last.pop(conversation)
        if last is not None:
            self._leave(last)
