"""Key escaping: no input can reach, forge or collide with another key."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplane.services.common.model.keys import KeyLayout, escape, prefix_range_end, unescape

HOSTILE = [
    "a/b",
    "../../nodes/x",
    "..",
    ".",
    "/",
    "\x00",
    "a\x00b",
    "é",
    "会话",
    "🙂",
    "x" * 256,
    "%2F",
    "a%2Fb",
    "%",
    " ",
    "\n",
]


@pytest.mark.parametrize("part", HOSTILE)
def test_hostile_parts_never_contain_a_separator_and_round_trip(part: str) -> None:
    escaped = escape(part)
    assert "/" not in escaped
    assert unescape(escaped) == part


def test_ids_that_differ_only_in_escaping_get_distinct_keys() -> None:
    layout = KeyLayout("/p/")
    keys = {layout.handle("t", c) for c in ["a/b", "a%2Fb", "a%252Fb", "a b", "a+b", "a%20b"]}
    assert len(keys) == 6


def test_a_tenant_prefix_never_covers_another_tenant() -> None:
    layout = KeyLayout("/p/")
    prefix = layout.tenant_handles_prefix("ab")
    assert not layout.handle("abc", "x").startswith(prefix)
    assert not layout.handle("ab/c", "x").startswith(prefix)
    assert layout.handle("ab", "c/x").startswith(prefix)


def test_conversation_cannot_reach_a_node_key() -> None:
    layout = KeyLayout("/p/")
    forged = layout.handle("t", "../../nodes/d0")
    assert forged.startswith(layout.handles_prefix())
    assert layout.handle_parts(forged) == ("t", "../../nodes/d0")


@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_escaping_is_injective(a: str, b: str) -> None:
    if a != b:
        assert escape(a) != escape(b)
    assert unescape(escape(a)) == a


def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    assert prefix_range_end(b"/p/a/") == b"/p/a0"
    assert prefix_range_end(b"a\xff") == b"b"


def test_the_view_range_holds_handles_loads_and_nodes_and_nothing_else() -> None:
    """The cluster view watches one key range; every other kind of key must fall outside it."""
    layout = KeyLayout("/p/")
    low, high = layout.handles_prefix(), prefix_range_end(layout.nodes_prefix())
    inside = [layout.handle("t", "c"), layout.load("n"), layout.node("n"), layout.handle("~", "\uffff")]
    outside = [
        layout.checkout("t", "c"),
        layout.claimed("n", "i", "r"),
        layout.by_node("n", "i", "r"),
        layout.release("n", "c"),
        layout.election("eviction"),
    ]
    assert all(low <= key < high for key in inside)
    assert not any(low <= key < high for key in outside)
