"""A size-bounded map forgets the least recently written entries first."""

from __future__ import annotations

from kvplane.services.common.runtime.bounded_map import BoundedMap


def test_past_the_limit_the_least_recently_written_entry_goes() -> None:
    m: BoundedMap[str, int] = BoundedMap(2)
    m.put("a", 1)
    m.put("b", 2)
    m.put("a", 10)  # a write refreshes "a": "b" is now the oldest
    m.put("c", 3)
    assert "b" not in m and m.get("a") == 10 and m.get("c") == 3 and len(m) == 2


def test_a_read_does_not_refresh_an_entry() -> None:
    m: BoundedMap[str, int] = BoundedMap(2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1
    m.put("c", 3)
    assert "a" not in m and "b" in m


def test_pop_removes_and_returns_and_a_missing_key_is_none() -> None:
    m: BoundedMap[str, int] = BoundedMap(4)
    m.put("a", 1)
    assert m.pop("a") == 1 and m.pop("a") is None and m.get("a") is None and len(m) == 0


def test_a_limit_of_zero_keeps_nothing() -> None:
    m: BoundedMap[str, int] = BoundedMap(0)
    m.put("a", 1)
    assert len(m) == 0 and m.get("a") is None
