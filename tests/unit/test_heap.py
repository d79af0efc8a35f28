"""A serving process freezes what start-up built, so that full collections skip it."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest

from kvplane.services.common.runtime.heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_start_up_objects_are_frozen_and_later_ones_are_not(unfrozen: None) -> None:
    built_at_start = [object() for _ in range(1000)]
    frozen = freeze_startup_heap()
    assert frozen >= 1000
    # Frozen objects that die later leave the count (other threads of this process may free some
    # at any moment); nothing joins it without another freeze.
    assert gc.get_freeze_count() <= frozen
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in built_at_start)  # frozen objects are in no generation
    later = [[] for _ in range(10)]
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(o) in tracked for o in later)


@pytest.mark.parametrize(
    "module",
    [
        "kvplane.services.process",
        "kvplane.services.gateway.cli",
        "kvplane.services.epp.cli",
        "kvplane.services.sidecar.cli",
    ],
)
def test_every_serving_entry_point_freezes_its_heap_once_started(module: str) -> None:
    __import__(module)
    assert sys.modules[module].freeze_startup_heap is freeze_startup_heap
