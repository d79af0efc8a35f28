"""The demo's table says where each prompt's KV came from and what each decision means."""

from __future__ import annotations

from kvplane.services.client.routing_client import DECISION_NAMES
from kvplane.services.devstack.demo import DECISION_MEANINGS, DemoTurn, demo_table


def test_every_decision_routing_can_make_has_a_meaning() -> None:
    assert set(DECISION_MEANINGS) == set(DECISION_NAMES.values()) - {"unspecified"}


def test_the_table_marks_the_turn_after_a_reset_and_explains_its_decisions() -> None:
    turns = [
        DemoTurn("demo-0", 1, 300, 250.0, "recompute_no_handle", 0, 0, 300, "a"),
        DemoTurn("demo-0", 2, 700, 120.0, "pull", 380, 0, 320, "b", reset_before=True),
    ]
    text = demo_table(turns)
    rows = text.splitlines()
    assert rows[2].split()[:3] == ["demo-0", "2*", "700"]
    assert "*: P's prefix cache was reset just before this turn" in text
    assert f"  pull: {DECISION_MEANINGS['pull']}" in text
    assert f"  recompute_no_handle: {DECISION_MEANINGS['recompute_no_handle']}" in text
