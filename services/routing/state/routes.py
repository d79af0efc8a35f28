"""What a router remembers of the routes it made: each route until its report, each
conversation's last prefill and decode nodes, and the engine pairs that have met.

A route's record lets its report teach the cost model (only turns this router
routed do, once each) and correct the prefill record. A first pull between a
prefill engine and a holder pays the NIXL handshake; later ones do not.

Pure bookkeeping: no I/O, no clock reads. Bounded, least recently written out: best effort.
"""

from __future__ import annotations

from collections import Counter
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


class RouteBook:
    """Routes awaiting their reports, last prefill and decode nodes, and engine pairs that have met."""

    def __init__(self, *, max_routes: int, max_conversations: int) -> None:
        self._routes: BoundedMap[str, RouteRecord] = BoundedMap(max_routes)
        # (prefill node id, decode node id) of each conversation's last routed turn.
        self._last: BoundedMap[tuple[str, str], tuple[str, str]] = BoundedMap(
            max_conversations, on_evict=lambda _key, last: self._leave(last[0])
        )
        # How many of those conversations each prefill node served last (`RouteSnapshot.prefill_homes`).
        self._homes: Counter[str] = Counter()
        # (prefill node id, holder engine id): asked for membership only (`RouteSnapshot.contacted`).
        self.contacted: BoundedMap[tuple[str, str], None] = BoundedMap(max_conversations)

    def last_prefill(self, conversation: tuple[str, str]) -> str:
        """The prefill node of the conversation's previous turn ("" if not remembered)."""
        last = self._last.get(conversation)
        return last[0] if last else ""

    def last_decode(self, conversation: tuple[str, str]) -> str:
        """The decode node of the conversation's previous turn ("" if not remembered)."""
        last = self._last.get(conversation)
        return last[1] if last else ""

    def contact(self, prefill_node_id: str, holder_engine_id: str) -> bool:
        """Records that the two engines meet; True if it is their first time."""
        pair = (prefill_node_id, holder_engine_id)
        first = pair not in self.contacted
        self.contacted.put(pair, None)
        return first

    def routed(self, route_id: str, record: RouteRecord) -> None:
        key = (record.tenant, record.conversation)
        prefill_node_id = record.prefill_node_id
        if record.decision is Decision.PREFILL_ON_DECODE:
            # No prefill node served the turn: the last one that did still holds the history.
            prefill_node_id = self.last_prefill(key)
        previous = self._last.get(key)
        if previous is not None:
            self._leave(previous[0])
        self._last.put(key, (prefill_node_id, record.decode_node_id))
        if prefill_node_id:
            self._homes[prefill_node_id] += 1
        self._routes.put(route_id, record)

    def homes(self) -> Mapping[str, int]:
        """Per prefill node, the remembered conversations whose last turn it served."""
        return self._homes

    def _leave(self, prefill_node_id: str) -> None:
        if not prefill_node_id:
            return
        self._homes[prefill_node_id] -= 1
        if self._homes[prefill_node_id] <= 0:
            del self._homes[prefill_node_id]

    def reported(self, route_id: str) -> RouteRecord | None:
        """The route's record, once: a second report of it finds none."""
        return self._routes.pop(route_id)

    def forget(self, conversation: tuple[str, str]) -> None:
        last = self._last.pop(conversation)
        if last is not None:
            self._leave(last[0])
