"""The sim-engine's retention: what a finished request keeps for a remote reader, and every way it is
freed (a reader's notification, its deadline, a release command, a drain)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvplane.connector.simengine import retention as retention_module
from kvplane.connector.simengine.block_content import root_hash
from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.retention import Retention
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.services.common.model.handles import KEY_PULL_MS, KEY_PULLED_TOKENS
from tests.support.polling import until

BS = 16
NUM_BLOCKS = 64
BLOCK_BYTES = 128


@dataclass
class Holder:
    engine_id: str = "sim-decode-1"
    incarnation: str = "life-1"
    side_channel_port: int = 5600


@dataclass
class Observer:
    """Records the handles it hears of, on which thread; `fail` makes every call raise. A move is
    stored at once, as with no control plane, unless `hold_moves`: then its `settle` waits in
    `settles` for the test to answer, as the control plane's answer to a relocation would."""

    retained: list[dict[str, Any]] = field(default_factory=list)
    freed: list[tuple[str, int]] = field(default_factory=list)
    # Whether each freed handle's blocks were read, by request id.
    reads: dict[str, bool] = field(default_factory=dict)
    moved: list[dict[str, Any]] = field(default_factory=list)
    fail: bool = False
    hold_moves: bool = False
    settles: list[Callable[[bool], None]] = field(default_factory=list)

    def check_pull(self, kv_transfer_params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        return None

    def on_handle_retained(
        self,
        kv_transfer_params: dict[str, Any],
        all_token_ids: Sequence[int],
        retained_bytes: int,
        request_kv_transfer_params: Mapping[str, Any],
    ) -> None:
        if self.fail:
            raise RuntimeError("observer down")
        self.retained.append(dict(kv_transfer_params, retained_bytes=retained_bytes))

    def on_blocks_freed(self, request_id: str, read: bool) -> None:
        if self.fail:
            raise RuntimeError("observer down")
        self.freed.append((request_id, threading.get_ident()))
        self.reads[request_id] = read

    def on_handle_moved(
        self, request_id: str, kv_transfer_params: dict[str, Any], settle: Callable[[bool], None]
    ) -> None:
        if self.fail:
            raise RuntimeError("observer down")
        self.moved.append(dict(kv_transfer_params))
        if self.hold_moves:
            self.settles.append(settle)
        else:
            settle(True)


def make(**settings: Any) -> tuple[Retention, BlockPool, SimEngineMetrics, Observer]:
    """A retention whose host tier copies a handle only when a move is wanted, unless
    `host_copy_ahead=True` is given (the tests of copies ahead, below the others)."""
    settings.setdefault("host_copy_ahead", False)
    s = SimEngineSettings(block_size=BS, num_blocks=NUM_BLOCKS, bytes_per_block=BLOCK_BYTES, **settings)
    pool = BlockPool(NUM_BLOCKS, BLOCK_BYTES, BS, root_hash(s.model), host_blocks=s.host_kv_blocks)
    metrics = SimEngineMetrics(s.model)
    retention = Retention(s, pool, metrics, Holder())
    observer = Observer()
    retention.observer = observer
    return retention, pool, metrics, observer


def keep(retention: Retention, pool: BlockPool, request_id: str, kind: Any, blocks: int = 2) -> Any:
    ids = pool.allocate(blocks)
    tokens = list(range(blocks * BS))
    return retention.keep(request_id, kind, ids, len(tokens), tokens, 5, {"kvplane_tenant": "t"})


def frees(metrics: SimEngineMetrics, kind: str, reason: str) -> float:
    labels = {"model_name": "kvplane-sim", "engine": "0", "kind": kind, "reason": reason}
    return metrics.registry.get_sample_value("kvplane_sim_retained_frees_total", labels) or 0.0


def unmatched(metrics: SimEngineMetrics, kind: str) -> float:
    labels = {"model_name": "kvplane-sim", "engine": "0", "kind": kind}
    return metrics.registry.get_sample_value("kvplane_sim_notifications_unmatched_total", labels) or 0.0


# --- keeping ---------------------------------------------------------------------------------------


def test_a_finished_decode_keeps_its_blocks_as_a_handle_naming_its_holder() -> None:
    retention, pool, _, observer = make()
    params = keep(retention, pool, "r1", "decode_handle")
    assert params["do_remote_decode"] is True and params["remote_request_id"] == "r1"
    assert params["remote_engine_id"] == "sim-decode-1" and params["remote_incarnation"] == "life-1"
    assert params["remote_port"] == 5600 and params["remote_num_tokens"] == 2 * BS
    assert (
        len(params["remote_block_ids"][0]) == 2 and params["remote_blocks_expiry_time"] > time.perf_counter()
    )
    assert retention.count == 1 and retention.handle_ids() == ["r1"]
    assert retention.retained_bytes == 2 * BLOCK_BYTES and pool.free_blocks == NUM_BLOCKS - 2
    assert [p["remote_request_id"] for p in observer.retained] == ["r1"], "the observer hears of D's handle"
    assert observer.retained[0]["retained_bytes"] == 2 * BLOCK_BYTES
    [described] = retention.describe()
    assert (
        described["kind"] == "decode_handle"
        and described["num_blocks"] == 2
        and described["expires_in_s"] > 0
    )


def test_a_prefill_lease_says_what_was_pulled_and_is_no_handle() -> None:
    retention, pool, _, observer = make()
    params = keep(retention, pool, "p1", "prefill_lease")
    assert params["do_remote_prefill"] is True and params[KEY_PULLED_TOKENS] == 5
    assert "remote_blocks_expiry_time" not in params
    assert retention.count == 1 and retention.handle_ids() == [] and observer.retained == []


def test_a_prefill_lease_says_how_long_its_pull_took_and_a_lease_that_pulled_nothing_does_not() -> None:
    retention, pool, _, _ = make()
    ids = pool.allocate(2)
    tokens = list(range(2 * BS))
    timed = retention.keep("p1", "prefill_lease", ids, len(tokens), tokens, 5, {}, pull_ms=12.3456)
    assert timed is not None and timed[KEY_PULL_MS] == 12.346
    untimed = retention.keep("p2", "prefill_lease", pool.allocate(2), len(tokens), tokens, 0, {}, pull_ms=0.0)
    assert untimed is not None and KEY_PULL_MS not in untimed and untimed[KEY_PULLED_TOKENS] == 0


def test_a_request_that_keeps_nothing_gives_its_blocks_back() -> None:
    retention, pool, _, _ = make()
    assert keep(retention, pool, "r1", None) is None
    assert pool.free_blocks == NUM_BLOCKS and retention.count == 0 and retention.blocks_freed.is_set()
    assert retention.keep("r2", "decode_handle", [], 0, [], 0, {}) is None, "no blocks, nothing to keep"


def test_a_draining_engine_frees_every_handle_and_keeps_no_new_one_but_still_leases_to_d() -> None:
    retention, pool, metrics, observer = make()
    keep(retention, pool, "r1", "decode_handle")
    keep(retention, pool, "p1", "prefill_lease")
    retention.drain()
    assert retention.count == 0 and retention.retained_bytes == 0 and pool.free_blocks == NUM_BLOCKS
    assert frees(metrics, "decode_handle", "drain") == 1 and frees(metrics, "prefill_lease", "drain") == 1
    assert [r for r, _ in observer.freed] == ["r1"], "only D handles are the observer's"
    assert keep(retention, pool, "r2", "decode_handle") is None and pool.free_blocks == NUM_BLOCKS
    assert keep(retention, pool, "p2", "prefill_lease") is not None, "the P leg's D still reads its lease"


def test_an_observer_that_fails_neither_stops_keeping_nor_freeing() -> None:
    retention, pool, metrics, observer = make()
    observer.fail = True
    assert keep(retention, pool, "r1", "decode_handle") is not None
    assert (
        retention.release_early("r1")
        and retention.count == 0
        and frees(metrics, "decode_handle", "early") == 1
    )


# --- release commands ------------------------------------------------------------------------------


def test_a_release_command_frees_the_handle_and_says_whether_it_was_held() -> None:
    retention, pool, metrics, observer = make()
    keep(retention, pool, "r1", "decode_handle")
    assert retention.release_early("r1") is True
    assert retention.count == 0 and pool.free_blocks == NUM_BLOCKS and retention.freeing_blocks() == 0
    assert frees(metrics, "decode_handle", "early") == 1 and [r for r, _ in observer.freed] == ["r1"]
    assert retention.release_early("r1") is False and retention.release_early("never") is False


async def test_a_release_from_the_agents_thread_is_carried_out_on_the_engines_loop() -> None:
    retention, pool, _, observer = make()
    retention.bind(asyncio.get_running_loop())
    keep(retention, pool, "r1", "decode_handle", blocks=3)
    held = await asyncio.to_thread(retention.release_early, "r1")
    assert held is True
    await until(lambda: retention.count == 0, "the release to be carried out")
    assert observer.freed == [("r1", threading.get_ident())], "freed on the loop's thread, not the agent's"
    assert retention.freeing_blocks() == 0


def test_blocks_of_a_release_not_yet_carried_out_count_as_on_their_way() -> None:
    retention, pool, _, _ = make()
    loop = asyncio.new_event_loop()  # bound, never run: the command waits there
    try:
        retention.bind(loop)
        keep(retention, pool, "r1", "decode_handle", blocks=3)
        assert retention.release_early("r1") is True
        assert retention.freeing_blocks() == 3 and retention.count == 1
    finally:
        loop.close()


# --- readers' notifications and deadlines ----------------------------------------------------------


@dataclass
class Notifications:
    """A NIXL agent's notification queue; `fail_next` makes the next poll raise."""

    queue: list[bytes] = field(default_factory=list)
    fail_next: bool = False
    polls: int = 0

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        self.polls += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("UCX hiccup")
        out, self.queue = self.queue, []
        return [("reader", m) for m in out]


@pytest.fixture
async def polled() -> AsyncIterator[tuple[Retention, BlockPool, SimEngineMetrics, Notifications]]:
    retention, pool, metrics, _ = make()
    notifications = Notifications()
    task = asyncio.create_task(retention.notification_loop(notifications))  # type: ignore[arg-type]
    try:
        yield retention, pool, metrics, notifications
    finally:
        task.cancel()


def _read(request_id: Any) -> bytes:
    return json.dumps({"request_id": request_id}).encode()


async def test_a_readers_notification_frees_what_it_read(
    polled: tuple[Retention, BlockPool, SimEngineMetrics, Notifications],
) -> None:
    retention, pool, metrics, notifications = polled
    keep(retention, pool, "r1", "decode_handle")
    keep(retention, pool, "p1", "prefill_lease")
    notifications.queue.append(_read("p1"))
    await until(lambda: frees(metrics, "prefill_lease", "read") == 1, "the lease to be freed")
    assert retention.handle_ids() == ["r1"]


async def test_the_observer_is_told_which_frees_were_reads() -> None:
    retention, pool, _, observer = make()
    notifications = Notifications()
    keep(retention, pool, "read-me", "decode_handle")
    keep(retention, pool, "drop-me", "decode_handle")
    task = asyncio.create_task(retention.notification_loop(notifications))  # type: ignore[arg-type]
    try:
        notifications.queue.append(_read("read-me"))
        await until(lambda: "read-me" in observer.reads, "the read to free the handle")
    finally:
        task.cancel()
    assert retention.release_early("drop-me") is True
    assert observer.reads == {"read-me": True, "drop-me": False}


async def test_a_second_read_and_a_read_of_something_never_held_are_counted_apart(
    polled: tuple[Retention, BlockPool, SimEngineMetrics, Notifications],
) -> None:
    retention, pool, metrics, notifications = polled
    keep(retention, pool, "r1", "decode_handle")
    notifications.queue += [_read("r1"), _read("r1"), _read("never"), _read(7), b"not json"]
    await until(lambda: unmatched(metrics, "malformed") == 2, "every notification to be judged")
    assert frees(metrics, "decode_handle", "read") == 1
    assert unmatched(metrics, "after_read") == 1 and unmatched(metrics, "unknown") == 1


async def test_a_failed_poll_does_not_stop_later_frees(
    polled: tuple[Retention, BlockPool, SimEngineMetrics, Notifications],
) -> None:
    retention, pool, _, notifications = polled
    keep(retention, pool, "r1", "decode_handle")
    notifications.fail_next = True
    await until(lambda: not notifications.fail_next, "the failing poll")
    notifications.queue.append(_read("r1"))
    await until(lambda: retention.count == 0, "the read after the failed poll to free the handle")


def test_the_loop_polls_briskly_while_a_lease_awaits_its_read_and_less_while_only_handles_are_held() -> None:
    retention, pool, _, _ = make()
    assert retention.poll_interval() is None, "nothing held: poll when something is kept"
    keep(retention, pool, "r1", "decode_handle")
    assert retention.poll_interval() == retention_module.POLL_HOLDING_S
    keep(retention, pool, "p1", "prefill_lease")
    assert retention.poll_interval() == retention_module.POLL_LEASED_S
    assert retention_module.POLL_LEASED_S < retention_module.POLL_HOLDING_S
    assert retention.release_early("p1") is True
    assert retention.poll_interval() == retention_module.POLL_HOLDING_S
    assert retention.release_early("r1") is True
    assert retention.poll_interval() is None


async def test_blocks_kept_while_nothing_was_held_are_polled_for_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The idle wait is made endless: only the wake-up of a kept lease can end it. Before, the
    # loop slept its idle interval out, and a reader's READ waited for P's next poll that long.
    monkeypatch.setattr(retention_module, "POLL_IDLE_S", 3600.0)
    retention, pool, metrics, _ = make()
    notifications = Notifications()
    task = asyncio.create_task(retention.notification_loop(notifications))  # type: ignore[arg-type]
    try:
        await until(lambda: notifications.polls >= 1, "the first poll")
        keep(retention, pool, "p1", "prefill_lease")
        notifications.queue.append(_read("p1"))
        await until(lambda: frees(metrics, "prefill_lease", "read") == 1, "the lease's read to be polled")
    finally:
        task.cancel()


async def test_what_no_reader_read_is_freed_at_its_deadline() -> None:
    retention, pool, metrics, observer = make(decoder_kv_blocks_ttl=0.01, prefill_lease_s=3600)
    keep(retention, pool, "r1", "decode_handle")
    keep(retention, pool, "p1", "prefill_lease")
    reaper = asyncio.create_task(retention.reaper_loop())
    try:
        await until(lambda: retention.handle_ids() == [], "the handle's deadline")
    finally:
        reaper.cancel()
    assert frees(metrics, "decode_handle", "ttl") == 1 and [r for r, _ in observer.freed] == ["r1"]
    assert observer.reads == {"r1": False}, "an expiry is no read"
    expired = {"model_name": "kvplane-sim", "engine": "0"}
    assert metrics.registry.get_sample_value("vllm:nixl_num_kv_expired_reqs_total", expired) == 1
    assert retention.count == 1, "the lease's deadline is an hour away"


# --- the host tier -----------------------------------------------------------------------------------


def spills(metrics: SimEngineMetrics, outcome: str) -> float:
    labels = {"model_name": "kvplane-sim", "engine": "0", "outcome": outcome}
    return metrics.registry.get_sample_value("kvplane_sim_host_spills_total", labels) or 0.0


async def test_a_spill_moves_the_oldest_handles_to_host_blocks_stamp_and_all() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=8)
    old = keep(retention, pool, "old", "decode_handle", blocks=3)["remote_block_ids"][0]
    keep(retention, pool, "new", "decode_handle", blocks=3)
    keep(retention, pool, "lease", "prefill_lease", blocks=3)
    content = pool.array[old].copy()
    free = pool.free_blocks

    assert retention.spill(2) == 3  # the oldest handle is enough; leases never move
    assert retention.spilling_blocks == 3
    await until(lambda: spills(metrics, "moved") == 1, "the copy to end")

    [moved] = observer.moved
    host = moved["remote_block_ids"][0]
    assert moved["remote_request_id"] == "old" and all(NUM_BLOCKS <= b < NUM_BLOCKS + 8 for b in host)
    assert (pool.array[host] == content).all(), "the stamp travels with the content"
    assert pool.free_blocks == free + 3 and pool.host_free_blocks == 5 and retention.spilling_blocks == 0
    assert retention.retained_bytes == 6 * BLOCK_BYTES and retention.host_bytes == 3 * BLOCK_BYTES
    assert {d["request_id"]: d["tier"] for d in retention.describe()} == {
        "old": "host",
        "new": "device",
        "lease": "device",
    }
    assert retention.handle_ids() == ["old", "new"], "a moved handle is still a published one"


@pytest.mark.parametrize(
    ("host_kv_ttl_s", "longer_s"),
    [(900.0, 840.0), (10.0, 0.0)],  # 900 s from the turn's end, not D's 60; a shorter one: D's 60
)
async def test_a_moved_handle_is_offered_for_the_host_tiers_ttl_and_never_less_than_ds(
    host_kv_ttl_s: float, longer_s: float
) -> None:
    retention, pool, metrics, observer = make(
        host_kv_blocks=8, decoder_kv_blocks_ttl=60.0, host_kv_ttl_s=host_kv_ttl_s
    )
    kept = keep(retention, pool, "h", "decode_handle", blocks=2)
    retention.spill(2)
    await until(lambda: spills(metrics, "moved") == 1, "the copy")
    [moved] = observer.moved
    longer = moved["remote_blocks_expiry_time"] - kept["remote_blocks_expiry_time"]
    assert longer == pytest.approx(longer_s)
    assert retention.describe()[0]["expires_in_s"] > longer_s


async def test_a_full_host_tier_frees_its_oldest_handles_and_one_too_large_never_moves() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4)
    for name in ("a", "b"):
        keep(retention, pool, name, "decode_handle", blocks=2)
    retention.spill(4)
    await until(lambda: spills(metrics, "moved") == 2, "both copies")
    keep(retention, pool, "c", "decode_handle", blocks=3)
    keep(retention, pool, "huge", "decode_handle", blocks=5)

    retention.spill(100)
    await until(lambda: spills(metrics, "moved") == 3, "the third copy")

    assert frees(metrics, "decode_handle", "host_full") == 2
    assert [name for name, _ in observer.freed] == ["a", "b"]
    assert {d["request_id"]: d["tier"] for d in retention.describe()} == {"c": "host", "huge": "device"}


async def test_spills_and_host_drops_follow_the_control_planes_order_before_age() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4)
    for name in ("a", "b", "c"):
        keep(retention, pool, name, "decode_handle", blocks=2)
    # The leader values the youngest least; handles it leaves out follow, oldest first.
    retention.set_spill_order(["c", "gone"], [])
    assert retention.spill(4) == 4
    await until(lambda: spills(metrics, "moved") == 2, "two copies")
    assert [m["remote_request_id"] for m in observer.moved] == ["c", "a"]

    # Host memory is full; of the two there, the order drops "a" first.
    retention.set_spill_order(["b"], ["a", "c"])
    retention.spill(1)
    await until(lambda: spills(metrics, "moved") == 3, "the third copy")
    assert [name for name, _ in observer.freed] == ["a"]
    assert frees(metrics, "decode_handle", "host_full") == 1
    assert {d["request_id"]: d["tier"] for d in retention.describe()} == {"b": "host", "c": "host"}


async def test_a_handle_read_while_it_is_copied_stays_freed_and_gives_its_host_blocks_back() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4, host_copy_bytes_per_s=BLOCK_BYTES / 1800)
    keep(retention, pool, "r1", "decode_handle", blocks=2)  # an hour's copy
    retention.spill(2)
    await until(lambda: pool.host_free_blocks == 2, "the copy to begin, holding two host blocks")

    retention._on_notification(_read("r1"))  # its reader got there first
    await until(lambda: spills(metrics, "freed_first") == 1, "the copy to stop")

    assert observer.moved == [] and pool.host_free_blocks == 4 and retention.count == 0


async def test_a_release_of_a_moved_handle_frees_host_blocks_not_cache_blocks_on_their_way() -> None:
    retention, pool, metrics, _ = make(host_kv_blocks=4)
    keep(retention, pool, "r1", "decode_handle", blocks=2)
    retention.spill(2)
    await until(lambda: spills(metrics, "moved") == 1, "the copy")

    assert retention.release_early("r1") is True
    assert retention.freeing_blocks() == 0, "no cache block comes back from it"
    assert pool.host_free_blocks == 4 and retention.host_bytes == 0
    assert frees(metrics, "decode_handle", "early") == 1


def test_a_host_tier_switched_off_moves_nothing() -> None:
    retention, pool, _, _ = make(host_kv_blocks=8)
    keep(retention, pool, "r1", "decode_handle", blocks=2)
    retention.host_tier_enabled = False

    assert retention.spill(2) == 0
    assert retention.spilling_blocks == 0 and retention.describe()[0]["tier"] == "device"


async def test_a_release_of_a_handle_being_copied_counts_its_blocks_once() -> None:
    retention, pool, _, _ = make(host_kv_blocks=4, host_copy_bytes_per_s=BLOCK_BYTES / 1800)
    keep(retention, pool, "r1", "decode_handle", blocks=2)  # an hour's copy
    retention.spill(2)
    await until(lambda: pool.host_free_blocks == 2, "the copy to begin, holding two host blocks")
    elsewhere = asyncio.new_event_loop()  # the agent's command waits there, never carried out
    try:
        retention.bind(elsewhere)
        assert retention.release_early("r1") is True
        # Its two blocks are on their way once, by the copy, not again by the command.
        assert retention.freeing_blocks() + retention.spilling_blocks == 2
    finally:
        elsewhere.close()
        await retention.stop_spills()


async def test_a_move_command_moves_the_named_handle_and_counts_its_blocks_until_the_copy_starts() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4)
    keep(retention, pool, "old", "decode_handle", blocks=2)
    keep(retention, pool, "named", "decode_handle", blocks=2)
    elsewhere = asyncio.new_event_loop()  # the engine's loop, not running: the move waits there
    try:
        retention.bind(elsewhere)
        assert retention.move_to_host("named") == ""
        assert retention.freeing_blocks() == 2, "on their way from the command on"
    finally:
        elsewhere.close()
    retention.bind(asyncio.get_running_loop())
    assert retention.move_to_host("named") == ""  # on the engine's loop: started at once
    assert retention.freeing_blocks() == 0 and retention.spilling_blocks == 2
    await until(lambda: spills(metrics, "moved") == 1, "the copy")
    assert [m["remote_request_id"] for m in observer.moved] == ["named"], "the one named, not the oldest"
    # Moved, read or freed already: nothing left to do, and nothing refused.
    assert retention.move_to_host("named") == "" and retention.move_to_host("never-held") == ""
    assert spills(metrics, "moved") == 1


def test_a_move_the_engine_cannot_make_is_refused_with_the_reason() -> None:
    retention, pool, _, _ = make(host_kv_blocks=2)
    keep(retention, pool, "huge", "decode_handle", blocks=3)
    keep(retention, pool, "lease", "prefill_lease", blocks=1)
    assert "cannot move" in retention.move_to_host("huge")
    assert "cannot move" in retention.move_to_host("lease")
    retention.host_tier_enabled = False
    keep(retention, pool, "small", "decode_handle", blocks=1)
    assert "off" in retention.move_to_host("small")
    assert retention.freeing_blocks() == 0 and retention.spilling_blocks == 0


# --- the control plane's answer to a relocation ----------------------------------------------------


async def test_a_moved_handles_cache_blocks_stay_leased_until_the_relocation_is_stored() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=8, host_copy_ahead=True, relocation_wait_s=3600)
    observer.hold_moves = True
    kept = keep(retention, pool, "h", "decode_handle", blocks=3)
    device = kept["remote_block_ids"][0]
    content = pool.array[device].copy()
    await until(lambda: spills(metrics, "copied_ahead") == 1, "the copy ahead")
    free = pool.free_blocks

    assert retention.spill(1) == 3
    [moved] = observer.moved
    # Published, unanswered: a turn may still check the old handle out and read these blocks.
    assert pool.free_blocks == free and (pool.array[device] == content).all()
    assert retention.spilling_blocks == 3, "on their way, for demand reports"
    assert retention.describe()[0]["tier"] == "device" and retention.describe()[0]["moving_to_host"]
    assert retention.spill(1) == 3, "not moved twice"
    assert len(observer.moved) == 1 and retention.move_to_host("h") == ""
    assert spills(metrics, "moved") == 0

    observer.settles.pop()(True)  # stored: nobody can check the old handle out any more
    assert pool.free_blocks == free + 3 and retention.spilling_blocks == 0
    assert retention.describe()[0]["tier"] == "host" and spills(metrics, "moved") == 1
    assert all(NUM_BLOCKS <= b < NUM_BLOCKS + 8 for b in moved["remote_block_ids"][0])


async def test_a_refused_relocation_gives_the_host_blocks_back_and_the_reader_reads_the_cache() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4, relocation_wait_s=3600)
    observer.hold_moves = True
    device = keep(retention, pool, "h", "decode_handle", blocks=2)["remote_block_ids"][0]
    content = pool.array[device].copy()
    free = pool.free_blocks
    retention.spill(2)
    await until(lambda: len(observer.settles) == 1, "the copy, and its relocation published")
    assert pool.host_free_blocks == 2

    # A turn checked the handle out first: the control plane refuses the relocation.
    await asyncio.to_thread(observer.settles.pop(), False)  # from the agent's thread
    await until(lambda: spills(metrics, "refused") == 1, "the answer, on the engine's loop")
    assert pool.host_free_blocks == 4 and retention.spilling_blocks == 0 and retention.host_bytes == 0
    assert pool.free_blocks == free and (pool.array[device] == content).all(), "still stamped for its reader"
    # Whoever got there first frees it; it is never offered to the host tier again.
    assert retention.spill(2) == 0 and retention.move_to_host("h") == "" and len(observer.moved) == 1

    retention._on_notification(_read("h"))
    assert pool.free_blocks == free + 2 and frees(metrics, "decode_handle", "read") == 1
    assert spills(metrics, "moved") == 0


async def test_a_handle_freed_while_its_relocation_is_unanswered_gives_back_both_blocks() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4, relocation_wait_s=3600)
    observer.hold_moves = True
    keep(retention, pool, "h", "decode_handle", blocks=2)
    free = pool.free_blocks
    retention.spill(2)
    await until(lambda: len(observer.settles) == 1, "the relocation published")

    assert retention.release_early("h") is True
    assert retention.freeing_blocks() == 0, "its blocks were already on their way"
    assert pool.free_blocks == free + 2 and pool.host_free_blocks == 4 and retention.spilling_blocks == 0

    observer.settles.pop()(True)
    assert retention.count == 0 and pool.host_free_blocks == 4 and retention.host_bytes == 0
    assert spills(metrics, "moved") == 0 and frees(metrics, "decode_handle", "early") == 1


@pytest.mark.parametrize("stored", [True, False])
async def test_a_relocation_unanswered_in_time_moves_anyway_and_a_late_refusal_frees_it(stored: bool) -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4, relocation_wait_s=0.05)
    observer.hold_moves = True
    keep(retention, pool, "h", "decode_handle", blocks=2)
    free = pool.free_blocks
    retention.spill(2)
    # The control plane does not answer: D's memory is not held for it.
    await until(lambda: spills(metrics, "moved_unanswered") == 1, "the wait to run out")
    assert pool.free_blocks == free + 2 and retention.spilling_blocks == 0
    assert retention.describe()[0]["tier"] == "host" and pool.host_free_blocks == 2

    observer.settles.pop()(stored)
    if stored:  # where the turns will find it: it stays
        assert retention.describe()[0]["tier"] == "host" and pool.host_free_blocks == 2
    else:  # stored nowhere: nobody could ever read it
        assert retention.count == 0 and pool.host_free_blocks == 4
        assert frees(metrics, "decode_handle", "refused") == 1
    assert pool.free_blocks == free + 2 and spills(metrics, "moved") == 0


async def test_an_observer_that_fails_on_a_move_leaves_the_handle_where_it_is() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4)
    keep(retention, pool, "h", "decode_handle", blocks=2)
    free = pool.free_blocks
    observer.fail = True  # nobody is told of the move: nothing may free the cache blocks
    retention.spill(2)
    await until(lambda: spills(metrics, "refused") == 1, "the copy, and the move given up")
    assert pool.host_free_blocks == 4 and pool.free_blocks == free and retention.spilling_blocks == 0
    assert retention.describe()[0]["tier"] == "device"


# --- copies ahead ----------------------------------------------------------------------------------


async def test_a_handle_is_copied_ahead_as_it_is_kept_and_a_move_then_frees_its_blocks_at_once() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=8, host_copy_ahead=True)
    kept = keep(retention, pool, "h", "decode_handle", blocks=3)
    keep(retention, pool, "lease", "prefill_lease", blocks=2)
    device = kept["remote_block_ids"][0]
    content = pool.array[device].copy()
    await until(lambda: spills(metrics, "copied_ahead") == 1, "the copy ahead")

    # Still in the KV cache, read from there: only the host tier's free blocks show the copy.
    assert retention.describe()[0] | {"expires_in_s": 0} == {
        "request_id": "h",
        "kind": "decode_handle",
        "num_tokens": 3 * BS,
        "num_blocks": 3,
        "bytes": 3 * BLOCK_BYTES,
        "expires_in_s": 0,
        "tier": "device",
        "host_copy": True,
        "moving_to_host": False,
    }
    assert observer.moved == [] and pool.host_free_blocks == 5 and retention.host_bytes == 0
    free = pool.free_blocks

    assert retention.spill(1) == 3
    # No copy to wait for: the cache blocks are free and the handle relocated within the call.
    assert pool.free_blocks == free + 3 and retention.spilling_blocks == 0
    [moved] = observer.moved
    host = moved["remote_block_ids"][0]
    assert all(NUM_BLOCKS <= b < NUM_BLOCKS + 8 for b in host)
    assert (pool.array[host] == content).all(), "the stamp travels with the content"
    assert retention.host_bytes == 3 * BLOCK_BYTES and pool.host_free_blocks == 5
    assert spills(metrics, "moved") == 1 and retention.describe()[0]["tier"] == "host"


async def test_a_move_during_the_copy_ahead_waits_for_it_rather_than_copy_twice() -> None:
    retention, pool, metrics, observer = make(
        host_kv_blocks=4, host_copy_ahead=True, host_copy_bytes_per_s=BLOCK_BYTES / 0.2
    )
    keep(retention, pool, "h", "decode_handle", blocks=2)  # a 0.4 s copy ahead
    await until(lambda: pool.host_free_blocks == 2, "the copy ahead to begin")
    assert retention.spill(2) == 2 and retention.spilling_blocks == 2
    await until(lambda: spills(metrics, "moved") == 1, "the move, once the copy ahead is whole")
    assert pool.host_free_blocks == 2, "one copy's host blocks, not two"
    assert retention.spilling_blocks == 0 and [m["remote_request_id"] for m in observer.moved] == ["h"]


async def test_a_handle_freed_gives_back_its_copy_ahead_whole_or_under_way() -> None:
    retention, pool, metrics, _ = make(host_kv_blocks=4, host_copy_ahead=True)
    keep(retention, pool, "done", "decode_handle", blocks=2)
    await until(lambda: spills(metrics, "copied_ahead") == 1, "the first copy ahead")
    retention._on_notification(_read("done"))
    assert pool.host_free_blocks == 4 and retention.count == 0

    slow, pool2, _, _ = make(host_kv_blocks=4, host_copy_ahead=True, host_copy_bytes_per_s=BLOCK_BYTES / 1800)
    keep(slow, pool2, "slow", "decode_handle", blocks=2)  # an hour's copy ahead
    await until(lambda: pool2.host_free_blocks == 2, "the copy ahead to begin")
    slow.release_early("slow")
    await until(lambda: pool2.host_free_blocks == 4, "its host blocks back")
    assert slow.count == 0


async def test_copies_ahead_make_room_as_a_move_does_the_host_tiers_handles_first_then_older_copies() -> None:
    retention, pool, metrics, observer = make(host_kv_blocks=4, host_copy_ahead=True)
    for name in ("a", "b"):
        keep(retention, pool, name, "decode_handle", blocks=1)
    await until(lambda: spills(metrics, "copied_ahead") == 2, "two copies ahead")
    retention.spill(2)  # a and b live in the host tier now, in their copies' blocks
    keep(retention, pool, "c", "decode_handle", blocks=2)
    await until(lambda: spills(metrics, "copied_ahead") == 3, "c's copy ahead, in the free blocks")

    # No free block: the host tier's handles go first, in the leader's order.
    retention.set_spill_order([], ["b", "a"])
    keep(retention, pool, "d", "decode_handle", blocks=1)
    await until(lambda: spills(metrics, "copied_ahead") == 4, "d's copy ahead")
    assert [name for name, _ in observer.freed] == ["b"] and frees(metrics, "decode_handle", "host_full") == 1
    assert {d["request_id"]: (d["tier"], d["host_copy"]) for d in retention.describe()} == {
        "a": ("host", False),
        "c": ("device", True),
        "d": ("device", True),
    }

    # Then, with no handle left in the host tier, older copies ahead are given back, the oldest
    # first and no more than needed.
    keep(retention, pool, "e", "decode_handle", blocks=3)
    await until(lambda: spills(metrics, "copied_ahead") == 5, "e's copy ahead")
    assert [name for name, _ in observer.freed] == ["b", "a"]
    assert {d["request_id"]: (d["tier"], d["host_copy"]) for d in retention.describe()} == {
        "c": ("device", False),
        "d": ("device", True),
        "e": ("device", True),
    }

    # A move that finds no copy ahead makes its room the same way.
    retention.move_to_host("c")
    await until(lambda: spills(metrics, "moved") == 3, "c's move")
    assert {d["request_id"]: (d["tier"], d["host_copy"]) for d in retention.describe()} == {
        "c": ("host", False),
        "d": ("device", False),
        "e": ("device", False),
    }


async def test_no_copy_ahead_with_the_host_tier_switched_off() -> None:
    retention, pool, metrics, _ = make(host_kv_blocks=8, host_copy_ahead=True)
    retention.host_tier_enabled = False
    keep(retention, pool, "h", "decode_handle", blocks=2)
    assert pool.host_free_blocks == 8 and spills(metrics, "copied_ahead") == 0
    assert retention.describe()[0]["host_copy"] is False
