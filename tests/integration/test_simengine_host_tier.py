"""D's host tier: a request short of KV blocks moves a retained handle to host memory instead of
waiting for a release; the control plane learns the handle's new blocks by its relocation, and
the next turn pulls them from host memory over real NIXL, verified block by block.

D has 40 cache blocks of 16 tokens and 64 host blocks; a turn of 200 + 100 tokens keeps 19 of
them, so the next conversation's 400-token prompt (25 blocks) does not fit beside it. P runs
without a prefix cache, so a later turn's pull moves every token D holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.services.common.model.handles import KvTier
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.support.eviction_nodes import coordinator_of, start_replica
from tests.support.polling import eventually, until
from tests.support.simengine import (
    Engine,
    d_leg,
    engines,
    free_port,
    loads,
    p_leg,
    reference,
    sim,
    start_engine,
    stop_engine,
    tokens,
    wait_healthy,
)

CACHE_BLOCKS = 40
HOST_BLOCKS = 64


def _specs(plane: str) -> dict[str, SimEngineSettings]:
    return {
        "P": sim(
            role="prefill", engine_id="p-host", side_channel_port=free_port(), enable_prefix_caching=False
        ),
        "REF": sim(role="prefill", engine_id="ref-host", side_channel_port=free_port()),
        "D": sim(
            role="decode",
            engine_id="d-host",
            node_id="d-host",
            side_channel_port=free_port(),
            num_blocks=CACHE_BLOCKS,
            host_kv_blocks=HOST_BLOCKS,
            # Without the host tier, the second conversation fails after this long (503).
            kv_wait_timeout_s=10,
            # A move waits for the control plane's answer however slow a loaded machine makes it
            # (the bound on that wait has unit tests of its own).
            relocation_wait_s=300,
            control_plane=plane,
            eviction=plane,  # no eviction service here: the agent's command stream keeps retrying
            load_interval_s=0.1,
        ),
    }


@pytest.fixture
def cluster(tmp_path: Path, metadata_process: ServiceProcess) -> Iterator[dict[str, Engine]]:
    with engines(tmp_path, _specs(f"127.0.0.1:{metadata_process.grpc_port}")) as started:
        yield started


def _routed(params: dict[str, Any], conversation: str, tenant: str) -> dict[str, Any]:
    return {**params, "kvplane_tenant": tenant, "kvplane_conversation": conversation}


async def _turn(
    p: Engine,
    d: Engine,
    prompt: list[int],
    conversation: str,
    handle: dict[str, Any] | None = None,
    *,
    tenant: str = "acme",
    max_tokens: int = 100,
):  # type: ignore[no-untyped-def]
    """One P/D turn, routed as kvplane's gateway routes it (the blocking HTTP off the loop, which
    serves the metadata service the engines publish to)."""
    pr = await asyncio.to_thread(p_leg, p, prompt, handle)
    routed = _routed(pr["kv_transfer_params"], conversation, tenant)
    return pr, await asyncio.to_thread(d_leg, d, prompt, routed, max_tokens)


async def _in_tier(store: Store, conversation: str, tier: KvTier, tenant: str = "acme") -> bool:
    view = await store.get_handle(tenant, conversation)
    return view is not None and view.handle.tier is tier


async def test_a_short_d_moves_a_handle_to_host_memory_and_the_next_turn_pulls_it_from_there(
    cluster: dict[str, Engine], store: Store
) -> None:
    p, ref, d = cluster["P"], cluster["REF"], cluster["D"]
    prompt_a = tokens(1, 200)
    _, first = await _turn(p, d, prompt_a, "c-a")
    out_a = first["choices"][0]["token_ids"]
    device_params = first["kv_transfer_params"]
    rid = device_params["remote_request_id"]
    await eventually(lambda: _in_tier(store, "c-a", KvTier.DEVICE), timeout_s=60, what="the first publish")
    before = await store.get_handle("acme", "c-a")
    # D copies the handle to host memory as it keeps it (`host_copy_ahead`), and keeps it in its cache.
    await eventually(lambda: _copied_ahead(d, rid), timeout_s=60, what="the copy ahead of the first handle")

    # A second conversation's prompt needs more blocks than D has free beside the first handle.
    _, second = await _turn(p, d, tokens(2, 400), "c-b")
    assert len(second["choices"][0]["token_ids"]) == 100

    await eventually(lambda: _in_tier(store, "c-a", KvTier.HOST), timeout_s=60, what="the relocation")
    view = await store.get_handle("acme", "c-a")
    assert view is not None and before is not None
    moved = view.handle
    assert moved.vllm.remote_request_id == rid
    # Offered for the host tier's TTL from the turn's end (an hour), not D's (8 minutes).
    longer_s = (moved.wall_expiry_unix_ms - before.handle.wall_expiry_unix_ms) / 1000
    assert longer_s == pytest.approx(3600 - 480, abs=1)
    assert all(CACHE_BLOCKS <= b < CACHE_BLOCKS + HOST_BLOCKS for b in moved.vllm.remote_block_ids[0])
    assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 1
    assert {"request_id": rid, "tier": "host"}.items() <= next(
        h for h in d.state()["retained"] if h["request_id"] == rid
    ).items()

    # The next turn of the first conversation: routing checks the handle out and P pulls it.
    checked = await store.check_out("acme", "c-a", route_id="r-a2")
    prompt_a2 = prompt_a + out_a + tokens(3, 40)
    pulled = loads(p, "pulled")
    pr = await asyncio.to_thread(p_leg, p, prompt_a2, checked.handle.prefill_kv_transfer_params())
    assert loads(p, "pulled") == pulled + 1
    assert pr["usage"]["prompt_tokens_details"]["cached_tokens"] == moved.num_tokens
    assert pr["choices"][0]["token_ids"] == await asyncio.to_thread(reference, ref, prompt_a2, 1)
    await eventually(lambda: _freed(d, rid), timeout_s=60, what="D to free the host blocks after the read")
    assert d.metric("kvplane_sim_host_reads_total") == 1

    # The handle as it was before the move names cache blocks no longer stamped for it: a reader
    # that still has it recomputes, and never uses them.
    failed = p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased")
    stale = await asyncio.to_thread(p_leg, p, prompt_a2, device_params)
    assert p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased") == failed + 1
    assert stale["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stale["choices"][0]["token_ids"] == pr["choices"][0]["token_ids"]


async def test_a_turn_that_checked_a_handle_out_before_d_moved_it_still_pulls_it_from_ds_cache(
    tmp_path: Path, metadata_process: ServiceProcess, store: Store
) -> None:
    """Routing checks a handle out just as D, short of blocks, moves it to host memory: the control
    plane refuses the relocation, so D keeps the cache blocks for the turn that took them, and that
    turn's P pulls them whole instead of failing their check and recomputing."""
    specs = _specs(f"127.0.0.1:{metadata_process.grpc_port}")
    # The other conversation waits for the race's blocks until P reads them: however slow this machine.
    specs["D"] = dataclasses.replace(specs["D"], kv_wait_timeout_s=300)
    with engines(tmp_path, {"P": specs["P"], "REF": specs["REF"], "D": specs["D"]}) as started:
        p, ref, d = started["P"], started["REF"], started["D"]
        prompt = tokens(41, 200)
        _, first = await _turn(p, d, prompt, "c-race")
        rid = first["kv_transfer_params"]["remote_request_id"]
        await eventually(lambda: _in_tier(store, "c-race", KvTier.DEVICE), timeout_s=60, what="the publish")
        await eventually(lambda: _copied_ahead(d, rid), timeout_s=60, what="the copy ahead")
        checked = await store.check_out("acme", "c-race", route_id="r-race")

        # Another conversation needs more blocks than D has free: D moves the checked-out handle.
        other = asyncio.create_task(_turn(p, d, tokens(42, 400), "c-other"))

        async def refused() -> bool:
            return await asyncio.to_thread(d.metric, "kvplane_sim_host_spills_total", outcome="refused") == 1

        await eventually(refused, timeout_s=120, what="the control plane's refusal of the relocation")
        assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 0
        assert not other.done(), "the other conversation waits: the cache blocks are the reader's"

        failed = p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased")
        prompt2 = prompt + first["choices"][0]["token_ids"] + tokens(43, 40)
        pr = await asyncio.to_thread(p_leg, p, prompt2, checked.handle.prefill_kv_transfer_params())
        assert p.metric("kvplane_sim_kv_verify_failures_total", reason="not_leased") == failed
        assert pr["usage"]["prompt_tokens_details"]["cached_tokens"] == checked.handle.num_tokens
        assert pr["choices"][0]["token_ids"] == await asyncio.to_thread(reference, ref, prompt2, 1)

        # The read frees the blocks, and the waiting conversation runs in them.
        _, second = await asyncio.wait_for(other, timeout=300)
        assert len(second["choices"][0]["token_ids"]) == 100
        assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 0


async def _copied_ahead(d: Engine, request_id: str) -> bool:
    state = await asyncio.to_thread(d.state)
    held = [h for h in state["retained"] if h["request_id"] == request_id]
    return bool(held) and held[0]["tier"] == "device" and held[0]["host_copy"] is True


async def _freed(d: Engine, request_id: str) -> bool:
    return request_id not in await asyncio.to_thread(d.retained_ids)


def test_the_host_tier_is_switched_on_and_off_at_run_time(cluster: dict[str, Engine]) -> None:
    d = cluster["D"]
    assert d.state()["host_tier"] is True
    assert d.post("/sim/host_tier", {"enabled": False}) == {"host_tier": False}
    assert d.state()["host_tier"] is False
    assert d.post("/sim/host_tier", {"enabled": True}) == {"host_tier": True}
    with pytest.raises(urllib.error.HTTPError) as refused:
        d.post("/sim/host_tier", {"enabled": "yes"})
    assert refused.value.code == 400


async def test_a_restarted_d_leaves_no_handle_pointing_at_its_lost_host_tier(
    cluster: dict[str, Engine], store: Store, metadata_process: ServiceProcess, tmp_path: Path
) -> None:
    p, d = cluster["P"], cluster["D"]
    await _turn(p, d, tokens(11, 200), "c-lost")
    await _turn(p, d, tokens(12, 400), "c-other")
    await eventually(lambda: _in_tier(store, "c-lost", KvTier.HOST), timeout_s=60, what="the relocation")

    # D's process ends and starts again: its host memory, and every block in it, is gone.
    await asyncio.to_thread(stop_engine, d)
    again = start_engine("D-again", tmp_path, _specs(f"127.0.0.1:{metadata_process.grpc_port}")["D"])
    try:
        await asyncio.to_thread(wait_healthy, again)
        await eventually(lambda: _gone(store, "c-lost"), timeout_s=60, what="the lost handle's removal")
        assert await store.get_handle("acme", "c-other") is None
    finally:
        await asyncio.to_thread(stop_engine, again)


async def _gone(store: Store, conversation: str) -> bool:
    return await store.get_handle("acme", conversation) is None


async def test_a_short_d_moves_the_handle_the_leader_values_least_not_its_oldest(
    tmp_path: Path, etcd: LocalEtcd, prefix: str, metadata_process: ServiceProcess, store: Store
) -> None:
    """Two handles on D: an agent's, older, whose tenant comes back within a minute, and a
    report's, younger, whose tenant comes back after hours (past D's TTL). D short of blocks moves
    the report's, as the eviction leader's order says; by age it would move the agent's."""
    leader = await start_replica(etcd, prefix, policy={"policies": []})
    try:
        await eventually(lambda: _leads(leader), what="the eviction replica to lead")
        gaps = coordinator_of(leader).pipeline.values.gaps
        for i in range(300):
            gaps.observe_gap("agents", 2.0 + i % 60)
            gaps.observe_gap("reports", 7200.0 + i)
        plane = f"127.0.0.1:{metadata_process.grpc_port}"
        specs = _specs(plane)
        specs["D"] = dataclasses.replace(specs["D"], eviction=f"127.0.0.1:{leader.grpc_port}")
        with engines(tmp_path, {"P": specs["P"], "D": specs["D"]}) as started:
            p, d = started["P"], started["D"]
            # 100 + 50 tokens: 10 of D's 40 blocks each.
            await _turn(p, d, tokens(21, 100), "c-agent", tenant="agents", max_tokens=50)
            await _turn(p, d, tokens(22, 100), "c-report", tenant="reports", max_tokens=50)
            for tenant, conversation in (("agents", "c-agent"), ("reports", "c-report")):
                await eventually(
                    lambda t=tenant, c=conversation: _in_tier(store, c, KvTier.DEVICE, t),
                    timeout_s=60,
                    what=f"{conversation}'s publish",
                )
            report = await store.get_handle("reports", "c-report")
            assert report is not None
            report_rid = report.handle.vllm.remote_request_id
            await eventually(
                lambda: _first_in_order(d, report_rid), timeout_s=60, what="the leader's order at D"
            )

            # 300 + 50 tokens need 22 blocks; 20 are free: one handle must move.
            await _turn(p, d, tokens(23, 300), "c-new", tenant="agents", max_tokens=50)
            await eventually(
                lambda: _in_tier(store, "c-report", KvTier.HOST, "reports"),
                timeout_s=60,
                what="the report's relocation",
            )
            assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 1
            assert await _in_tier(store, "c-agent", KvTier.DEVICE, "agents"), "the agent's stays"
    finally:
        await leader.stop()


async def _leads(process: ServiceProcess) -> bool:
    return coordinator_of(process).is_leader


async def _first_in_order(d: Engine, request_id: str) -> bool:
    order = (await asyncio.to_thread(d.state))["spill_order"]["device"]
    return bool(order) and order[0] == request_id


async def test_the_leader_moves_an_aged_handle_to_host_memory_and_releases_it_when_d_cannot(
    tmp_path: Path, etcd: LocalEtcd, prefix: str, metadata_process: ServiceProcess, store: Store
) -> None:
    """The leader's age limit (1 s here) wants a handle's cache blocks back. D has a host tier,
    so the leader sends a move, not a release: the handle lives on there. With D's host tier
    switched off, D says so in a new hello on its command stream, and the leader releases the next
    handle at once, with no move for D to refuse."""
    leader = await start_replica(etcd, prefix, policy={"policies": [{"name": "max_age", "max_age_s": 1}]})
    try:
        await eventually(lambda: _leads(leader), what="the eviction replica to lead")
        specs = _specs(f"127.0.0.1:{metadata_process.grpc_port}")
        specs["D"] = dataclasses.replace(specs["D"], eviction=f"127.0.0.1:{leader.grpc_port}")
        with engines(tmp_path, {"P": specs["P"], "D": specs["D"]}) as started:
            p, d = started["P"], started["D"]
            coordinator = coordinator_of(leader)
            await eventually(lambda: _accepts_moves(leader, "d-host"), timeout_s=60, what="D's stream")
            await _turn(p, d, tokens(31, 100), "c-aged", max_tokens=50)
            await eventually(
                lambda: _in_tier(store, "c-aged", KvTier.HOST), timeout_s=60, what="the aged handle's move"
            )
            assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 1
            assert coordinator.metrics.moves.labels("max_age", "max_age")._value.get() == 1
            assert coordinator.metrics.releases.labels("max_age", "max_age")._value.get() == 0

            d.post("/sim/host_tier", {"enabled": False})

            async def refuses_moves() -> bool:
                return not await _accepts_moves(leader, "d-host")

            await eventually(refuses_moves, timeout_s=60, what="D's new hello, without moves")
            released = coordinator.metrics.releases.labels("max_age", "max_age")
            await _turn(p, d, tokens(32, 100), "c-released", max_tokens=50)
            await until(lambda: released._value.get() == 1, "the release", timeout_s=60)
            assert await _gone(store, "c-released")
            assert coordinator.metrics.moves.labels("max_age", "max_age")._value.get() == 1
            assert coordinator.metrics.commands_acked.labels("move", "error")._value.get() == 0
            assert d.metric("kvplane_sim_host_spills_total", outcome="moved") == 1
            assert await _in_tier(store, "c-aged", KvTier.HOST), "the age limit is not the host tier's"
    finally:
        await leader.stop()


async def _accepts_moves(leader: ServiceProcess, node_id: str) -> bool:
    session = coordinator_of(leader).sessions.get(node_id)
    return session is not None and session.accepts_moves
