"""The Router's record of its routes: each reported once, the last prefill and decode nodes
per conversation, and the engine pairs that have met."""

from __future__ import annotations

from kvplane.services.routing.policy import Decision
from kvplane.services.routing.state.routes import RouteBook, RouteRecord

# A conversation the book has never seen: homes() leaves no one out.
NOBODY = ("t", "nobody")


def record(conversation: str = "c", prefill: str = "p0", decode: str = "d0") -> RouteRecord:
    return RouteRecord("t", conversation, prefill, decode, "e-d0", 4096, Decision.RECOMPUTE_NO_HANDLE)


def test_a_route_is_reported_once_and_remembers_its_prefill_node() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    book.routed("r1", record(prefill="p1"), 0.0)
    assert book.last_prefill(("t", "c")) == "p1"
    assert book.reported("r1") == record(prefill="p1")
    assert book.reported("r1") is None
    # The report does not forget where the conversation went; its end does.
    assert book.last_prefill(("t", "c")) == "p1"
    book.forget(("t", "c"))
    assert book.last_prefill(("t", "c")) == ""


def test_a_route_remembers_its_decode_node_until_the_conversation_ends() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    assert book.last_decode(("t", "c")) == ""
    book.routed("r1", record(prefill="p1", decode="d1"), 0.0)
    book.routed("r2", record("c2", prefill="p0", decode="d0"), 0.0)
    assert (book.last_prefill(("t", "c")), book.last_decode(("t", "c"))) == ("p1", "d1")
    book.reported("r1")
    assert book.last_decode(("t", "c")) == "d1"
    book.forget(("t", "c"))
    assert book.last_decode(("t", "c")) == "" and book.last_decode(("t", "c2")) == "d0"


def test_the_first_meeting_of_two_engines_is_told_apart_from_later_ones() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    assert book.contact("p0", "e-d0") is True
    assert book.contact("p0", "e-d0") is False
    assert book.contact("p1", "e-d0") is True
    assert ("p0", "e-d0") in book.contacted


def test_the_book_is_bounded_oldest_routes_out_first() -> None:
    book = RouteBook(max_routes=2, max_conversations=2)
    for i in range(3):
        book.routed(f"r{i}", record(f"c{i}"), 0.0)
    assert book.reported("r0") is None and book.reported("r2") is not None
    assert book.last_prefill(("t", "c0")) == ""


def test_each_prefill_node_counts_the_active_conversations_it_served_last() -> None:
    book = RouteBook(max_routes=10, max_conversations=3)
    book.routed("r1", record("a", prefill="p0"), 0.0)
    book.routed("r2", record("b", prefill="p0"), 0.0)
    book.routed("r3", record("c", prefill="p1"), 0.0)
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 2, "p1": 1}
    # A conversation that moves counts for its new node only.
    book.routed("r4", record("a", prefill="p1"), 0.0)
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 1, "p1": 2}
    # One forgotten, or pushed out by the bound, no longer counts.
    book.forget(("t", "c"))
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 1, "p1": 1}
    book.routed("r5", record("d", prefill="p0"), 0.0)
    book.routed("r6", record("e", prefill="p0"), 0.0)  # "b", the oldest, is forgotten
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 2, "p1": 1}
    # A turn prefilled on D leaves its conversation counted where its history is.
    book.routed("r7", RouteRecord("t", "e", "d0", "d0", "", 4096, Decision.PREFILL_ON_DECODE), 0.0)
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 2, "p1": 1}


def test_a_conversation_is_not_counted_among_its_own_nodes_homes() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    book.routed("r1", record("a", prefill="p0"), 0.0)
    book.routed("r2", record("b", prefill="p0"), 0.0)
    assert dict(book.homes(0.0, ("t", "a"))) == {"p0": 1}
    assert dict(book.homes(0.0, NOBODY)) == {"p0": 2}


def test_a_conversation_stops_counting_once_its_last_turn_is_older_than_the_window() -> None:
    book = RouteBook(max_routes=10, max_conversations=10, active_s=60.0)
    book.routed("r1", record("a", prefill="p0"), 0.0)
    book.routed("r2", record("b", prefill="p1"), 30.0)
    assert dict(book.homes(59.0, NOBODY)) == {"p0": 1, "p1": 1}
    # "a" has had no turn for 60 s: it is no load on p0, though its last nodes are remembered.
    assert dict(book.homes(60.0, NOBODY)) == {"p1": 1}
    assert book.last_prefill(("t", "a")) == "p0"
    assert dict(book.homes(90.0, NOBODY)) == {}
    # Its next turn makes it active again, where that turn went.
    book.routed("r3", record("a", prefill="p1"), 100.0)
    assert dict(book.homes(100.0, NOBODY)) == {"p1": 1}
    # Forgotten while inactive, it takes nothing from the count.
    book.routed("r4", record("b", prefill="p1"), 200.0)
    book.forget(("t", "a"))
    assert dict(book.homes(200.0, NOBODY)) == {"p1": 1}


def test_a_conversation_routed_again_counts_from_its_latest_turn() -> None:
    book = RouteBook(max_routes=10, max_conversations=10, active_s=60.0)
    book.routed("r1", record("a", prefill="p0"), 0.0)
    book.routed("r2", record("a", prefill="p0"), 50.0)
    # Its first turn's window ends; its second's has not.
    assert dict(book.homes(70.0, NOBODY)) == {"p0": 1}
    assert dict(book.homes(110.0, NOBODY)) == {}


def test_a_conversation_pushed_out_by_the_bound_after_its_window_takes_nothing_twice() -> None:
    book = RouteBook(max_routes=10, max_conversations=1, active_s=60.0)
    book.routed("r1", record("a", prefill="p0"), 0.0)
    assert dict(book.homes(60.0, NOBODY)) == {}
    book.routed("r2", record("b", prefill="p0"), 61.0)  # "a" is forgotten for the bound
    assert dict(book.homes(61.0, NOBODY)) == {"p0": 1}


def test_each_prefill_node_carries_the_ordinal_of_the_last_turn_it_was_sent() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    assert dict(book.routed_order()) == {}
    book.routed("r1", record("a", prefill="p0"), 0.0)
    book.routed("r2", record("b", prefill="p1"), 0.0)
    book.routed("r3", record("c", prefill="p0"), 0.0)
    assert dict(book.routed_order()) == {"p0": 3, "p1": 2}
    # A turn prefilled on D sends no prefill node anything.
    book.routed("r4", RouteRecord("t", "c", "d0", "d0", "", 4096, Decision.PREFILL_ON_DECODE), 0.0)
    assert dict(book.routed_order()) == {"p0": 3, "p1": 2}
