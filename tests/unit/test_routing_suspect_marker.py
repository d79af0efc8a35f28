"""The suspect marker: a failed leg's node is marked for every replica, in the background, once
per failure; a mark that cannot be written costs the turn nothing."""

from __future__ import annotations

import logging

import pytest

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.routing.suspect_marker import SUSPECT_TTL_S, SuspectMarker
from tests.support.polling import eventually


class FakeStore:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.marks: list[tuple[NodeSuspect, int]] = []

    async def mark_suspect(self, suspect: NodeSuspect, ttl_s: int) -> None:
        self.marks.append((suspect, ttl_s))
        if self.fails:
            raise StoreUnavailable("etcd is down")


async def test_marks_of_one_failure_are_written_once_and_later_ones_again() -> None:
    store = FakeStore()
    marker = SuspectMarker(store)  # type: ignore[arg-type]
    marker.mark(NodeSuspect("p0", "inc-1", 10_000, "first"))
    # Within a second of the first: the same failure, reported by another leg.
    marker.mark(NodeSuspect("p0", "inc-1", 10_500, "same failure"))
    marker.mark(NodeSuspect("p0", "inc-1", 11_500, "later"))
    marker.mark(NodeSuspect("p0", "inc-2", 11_500, "a new incarnation"))

    async def written() -> bool:
        return len(store.marks) >= 3

    await eventually(written, what="three marks written")
    assert sorted(s.reason for s, _ in store.marks) == ["a new incarnation", "first", "later"]
    assert {ttl for _, ttl in store.marks} == {SUSPECT_TTL_S}


async def test_a_mark_that_cannot_be_written_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvplane.services.routing.suspect_marker")
    store = FakeStore(fails=True)
    SuspectMarker(store).mark(NodeSuspect("d0", "inc", 1_000, "leg failed"))  # type: ignore[arg-type]

    async def logged() -> bool:
        return any("could not mark node d0" in r.getMessage() for r in caplog.records)

    await eventually(logged, what="the failed write logged")
