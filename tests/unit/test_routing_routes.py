"""The Router's record of its routes: each reported once, the last prefill and decode nodes
per conversation, and the engine pairs that have met."""

from __future__ import annotations

from kvplane.services.routing.policy import Decision
from kvplane.services.routing.state.routes import RouteBook, RouteRecord


def record(conversation: str = "c", prefill: str = "p0", decode: str = "d0") -> RouteRecord:
    return RouteRecord("t", conversation, prefill, decode, "e-d0", 4096, Decision.RECOMPUTE_NO_HANDLE)


def test_a_route_is_reported_once_and_remembers_its_prefill_node() -> None:
    book = RouteBook(max_routes=10, max_conversations=10)
    book.routed("r1", record(prefill="p1"))
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
    book.routed("r1", record(prefill="p1", decode="d1"))
    book.routed("r2", record("c2", prefill="p0", decode="d0"))
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
        book.routed(f"r{i}", record(f"c{i}"))
    assert book.reported("r0") is None and book.reported("r2") is not None
    assert book.last_prefill(("t", "c0")) == ""


def test_each_prefill_node_counts_the_remembered_conversations_it_served_last() -> None:
    book = RouteBook(max_routes=10, max_conversations=3)
    book.routed("r1", record("a", prefill="p0"))
    book.routed("r2", record("b", prefill="p0"))
    book.routed("r3", record("c", prefill="p1"))
    assert dict(book.homes()) == {"p0": 2, "p1": 1}
    # A conversation that moves counts for its new node only.
    book.routed("r4", record("a", prefill="p1"))
    assert dict(book.homes()) == {"p0": 1, "p1": 2}
    # One forgotten, or pushed out by the bound, no longer counts.
    book.forget(("t", "c"))
    assert dict(book.homes()) == {"p0": 1, "p1": 1}
    book.routed("r5", record("d", prefill="p0"))
    book.routed("r6", record("e", prefill="p0"))  # "b", the oldest, is forgotten
    assert dict(book.homes()) == {"p0": 2, "p1": 1}
    # A turn prefilled on D leaves its conversation counted where its history is.
    book.routed("r7", RouteRecord("t", "e", "d0", "d0", "", 4096, Decision.PREFILL_ON_DECODE))
    assert dict(book.homes()) == {"p0": 2, "p1": 1}
