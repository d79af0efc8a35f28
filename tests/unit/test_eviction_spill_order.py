"""The leader's order of moves to a node's host tier: least expected reuse per byte first, and sent
only when the node would not already follow it."""

from __future__ import annotations

from kvplane.services.eviction.policy.gaps import GapStatistics
from kvplane.services.eviction.policy.model import HandleInfo, Snapshot
from kvplane.services.eviction.policy.value import ValueModel
from kvplane.services.eviction.spill_order import TierOrder, spill_orders

NOW = 1_000_000_000
TTL_MS = 480_000


def handle(handle_id: str, tenant: str, age_s: float, node: str = "d0", on_device: bool = True) -> HandleInfo:
    published = NOW - int(age_s * 1000)
    return HandleInfo(
        tenant,
        f"conv-{handle_id}",
        handle_id,
        node,
        retained_bytes=1 << 20,
        num_tokens=1024,
        published_unix_ms=published,
        wall_expiry_unix_ms=published + TTL_MS,
        on_device=on_device,
    )


def values() -> ValueModel:
    """Tenant "agents" comes back within seconds; tenant "reports" after two hours, past D's TTL."""
    gaps = GapStatistics()
    for i in range(300):
        gaps.observe_gap("agents", 2.0 + i % 60)
        gaps.observe_gap("reports", 7200.0 + i)
    return ValueModel(gaps)


def test_each_tier_is_ordered_least_expected_reuse_first_not_oldest_first() -> None:
    handles = (
        handle("a-old", "agents", age_s=20),
        handle("r-new", "reports", age_s=5),
        handle("a-new", "agents", age_s=3),
        handle("r-host", "reports", age_s=30, on_device=False),
        handle("a-host", "agents", age_s=40, on_device=False),
        handle("elsewhere", "reports", age_s=1, node="d1"),
    )
    request_ids = {h.handle_id: f"req-{h.handle_id}" for h in handles}
    orders = spill_orders(Snapshot(NOW, handles), values(), request_ids, 64, {"d0"})

    assert set(orders) == {"d0"}, "only the nodes that asked"
    d0 = orders["d0"]
    # The reports tenant's handle is the youngest on the device, yet the first to move.
    assert d0.device.order[0] == "req-r-new"
    assert set(d0.device.order) == {"req-r-new", "req-a-old", "req-a-new"}
    assert d0.device.held == ("req-a-old", "req-r-new", "req-a-new"), "oldest first"
    assert d0.host.order == ("req-r-host", "req-a-host")
    assert d0.host.held == ("req-a-host", "req-r-host")
    assert d0.device.worth["req-r-new"] < d0.device.worth["req-a-new"] / 2


def test_an_order_is_capped_and_leaves_out_handles_without_a_request_id() -> None:
    handles = tuple(handle(f"h{i}", "agents", age_s=i) for i in range(10))
    request_ids = {h.handle_id: f"req-{h.handle_id}" for h in handles if h.handle_id != "h9"}
    d0 = spill_orders(Snapshot(NOW, handles), values(), request_ids, 3, {"d0", "d2"})
    assert len(d0["d0"].device.order) == 3
    assert "req-h9" not in d0["d0"].device.held
    assert d0["d2"].device.held == () and d0["d2"].host.held == (), "a node with nothing held"


def tier(order: tuple[str, ...], held: tuple[str, ...], **worth: float) -> TierOrder:
    """A tier whose handles are worth 1.0 each unless `worth` says otherwise."""
    return TierOrder(order, held, {i: worth.get(i, 1.0) for i in held})


def test_a_node_that_would_move_its_handles_in_this_order_anyway_is_sent_nothing() -> None:
    held = ("a", "b", "c")  # oldest first
    assert tier(("a", "b"), held, a=0.5, b=0.8).followed_after(()), "age order: the node's own"
    assert TierOrder().followed_after(())
    assert not tier(("b", "a"), held, b=0.5, a=0.8).followed_after(())


def test_differences_within_a_part_filled_block_are_not_worth_an_order() -> None:
    # The leader puts b first by a hair (a last block's padding): the node's age order will do.
    assert tier(("b", "a"), ("a", "b"), b=0.990, a=1.0).followed_after(())
    assert not tier(("b", "a"), ("a", "b"), b=0.90, a=1.0).followed_after(())


def test_a_sent_order_holds_while_new_handles_join_its_end() -> None:
    assert tier(("b", "a", "c", "d"), ("a", "b", "c", "d"), b=0.2, a=0.4).followed_after(("b", "a"))
    # A handle of the last order that is gone is passed over by the node as by the leader.
    assert tier(("a", "c"), ("a", "c"), a=0.4).followed_after(("b", "a"))


def test_an_order_is_sent_again_when_the_node_would_act_otherwise() -> None:
    # The leader now values a well below b.
    assert not tier(("a", "b"), ("a", "b"), a=0.2).followed_after(("b", "a"))
    # b is held, named first last time, and now among the most valuable (out of the capped order).
    assert not tier(("a",), ("a", "b", "c"), a=0.2, c=0.5).followed_after(("b", "a"))
    # A new handle valued well below the ones named before it.
    assert not tier(("d", "b", "a"), ("a", "b", "d"), d=0.1, b=0.3, a=0.5).followed_after(("b", "a"))
