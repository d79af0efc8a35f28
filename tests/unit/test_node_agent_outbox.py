"""The node agent's outbox: bounded, never blocking, batches in order; release reports ride with
the publishes behind them, and wait a while for one."""

from __future__ import annotations

import random
import time

from kvplane.connector.node_agent.control_plane import Backoff
from kvplane.connector.node_agent.outbox import MAX_RELEASE_BATCH, Item, Outbox


def release(n: int) -> Item:
    return Item("release", remote_request_id=f"r{n}")


def read(n: int) -> Item:
    """The report of blocks P read: it may wait for a publish."""
    return Item("release", remote_request_id=f"r{n}", lingers=True)


def publish(n: int) -> Item:
    return Item("publish", remote_request_id=f"p{n}")


def test_a_full_outbox_drops_its_oldest_item_and_counts_it() -> None:
    box = Outbox(queue_max=3, batch_max=10)
    for n in range(5):
        box.put(release(n))
    assert [i.remote_request_id for i in box.items()] == ["r2", "r3", "r4"]
    assert box.counts() == (3, 2)


def test_a_batch_is_leading_releases_with_the_publishes_right_behind_them_in_order() -> None:
    box = Outbox(queue_max=100, batch_max=10)
    for item in (release(1), release(2), publish(3), publish(4), release(5), publish(6), publish(7)):
        box.put(item)
    assert [i.remote_request_id for i in box.take_batch()] == ["r1", "r2", "p3", "p4"]
    assert [i.remote_request_id for i in box.take_batch()] == ["r5", "p6", "p7"]
    assert box.take_batch() == []


def test_leading_publishes_go_without_the_releases_queued_after_them() -> None:
    box = Outbox(queue_max=100, batch_max=10)
    for item in (publish(1), release(2), publish(3)):
        box.put(item)
    assert [i.remote_request_id for i in box.take_batch()] == ["p1"]
    assert [i.remote_request_id for i in box.take_batch()] == ["r2", "p3"]


def test_reads_with_no_publish_behind_wait_for_one_until_their_linger_runs_out() -> None:
    box = Outbox(queue_max=100, batch_max=10)
    box.put(Item("release", remote_request_id="old", lingers=True, queued_at=time.monotonic() - 100.0))
    box.put(read(2))
    # The oldest waited past a long linger: sent now, with what queued behind it.
    assert [i.remote_request_id for i in box.take_batch(linger_s=50.0)] == ["old", "r2"]
    box.put(read(3))
    assert box.take_batch(linger_s=50.0) == []
    deadline = box.linger_deadline(50.0)
    assert deadline is not None and deadline > time.monotonic() + 40.0
    box.put(publish(4))
    assert box.linger_deadline(50.0) is None
    assert [i.remote_request_id for i in box.take_batch(linger_s=50.0)] == ["r3", "p4"]
    box.put(read(5))
    # No linger: sent at once.
    assert [i.remote_request_id for i in box.take_batch()] == ["r5"]


def test_reads_that_fill_a_batch_wait_no_longer() -> None:
    box = Outbox(queue_max=100, batch_max=3)
    for n in range(3):
        box.put(read(n))
    assert len(box.take_batch(linger_s=50.0)) == 3


def test_a_free_that_was_no_read_goes_at_once_and_takes_the_waiting_reads_along() -> None:
    box = Outbox(queue_max=100, batch_max=10)
    box.put(read(1))
    assert box.take_batch(linger_s=50.0) == []
    box.put(release(2))  # an expiry: a handle routing may still hand out
    assert box.linger_deadline(50.0) is None
    assert [i.remote_request_id for i in box.take_batch(linger_s=50.0)] == ["r1", "r2"]


def test_a_batch_keeps_to_the_outboxs_and_the_apis_limits() -> None:
    box = Outbox(queue_max=5_000, batch_max=3)
    for n in range(5):
        box.put(release(n))
    assert len(box.take_batch()) == 3
    wide = Outbox(queue_max=5_000, batch_max=5_000)
    for n in range(MAX_RELEASE_BATCH + 5):
        wide.put(release(n))
    assert len(wide.take_batch()) == MAX_RELEASE_BATCH


def test_an_unsent_batch_goes_back_to_the_head_within_the_bound() -> None:
    box = Outbox(queue_max=3, batch_max=2)
    for n in range(3):
        box.put(release(n))
    batch = box.take_batch()
    box.put(release(3))
    box.put(release(4))
    box.put_back(batch)
    # Back at the head; the bound drops the oldest, which are the returned ones.
    assert [i.remote_request_id for i in box.items()] == ["r2", "r3", "r4"]
    assert box.counts() == (3, 2)


def test_backoff_grows_to_its_ceiling_with_full_jitter_and_resets() -> None:
    backoff = Backoff(initial_s=0.1, max_s=1.0)
    # The jitter comes from the backoff's own generator: the `random` module is left alone.
    state = random.getstate()
    delays = [backoff.next_delay() for _ in range(12)]
    assert random.getstate() == state
    assert all(0.0 <= d <= 1.0 for d in delays)
    assert delays[0] <= 0.1 and max(delays[:2]) <= 0.2
    backoff.reset()
    assert backoff.next_delay() <= 0.1
