"""The tiered engine model: D's host memory beside its accelerators, spills instead of releases,
pulls from either tier, and llm-d's P/D + P2P path as a baseline."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimSummary, simulator_for
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.cluster import SimHandle
from kvplane.bench.sim.command import SimSpec, main
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.engine import Simulator
from kvplane.bench.sim.fleet import Fleet
from kvplane.bench.sim.retention import EngineOnly, PipelineRetention
from kvplane.bench.workloads import AgenticWorkload, Turn, agentic_turns
from kvplane.services.eviction.policy.low_value import LowValue

GIB = 1 << 30
# Decode nodes too small for the workload's retained KV: without a host tier, turns wait for
# memory and releases throw histories away.
SMALL_D = ClusterSpec(prefill_nodes=2, decode_nodes=2, decode_kv_capacity_bytes=8 * GIB)


def _one_tiered_d(costs: SimCosts, kv_tokens: int) -> ClusterSpec:
    """One P and one D with KV for `kv_tokens` tokens and 8 GiB of host memory."""
    return ClusterSpec(
        prefill_nodes=1,
        decode_nodes=1,
        decode_kv_capacity_bytes=costs.kv_bytes(kv_tokens),
        decode_host_bytes=8 * GIB,
    )


def _turns() -> list[Turn]:
    return list(agentic_turns(AgenticWorkload(seed=9, sessions_per_s=0.2, duration_s=600.0)))


def _run(name: str, cluster: ClusterSpec, turns: list[Turn] | None = None) -> SimSummary:
    return simulator_for(BASELINES[name], SimConfig(cluster=cluster)).run(turns or _turns(), name).summary


def test_released_handles_are_spilled_to_host_memory_and_pulled_from_there() -> None:
    pinned = _run("kvplane", SMALL_D)
    tiered = _run("kvplane", replace(SMALL_D, decode_host_bytes=64 * GIB))
    assert pinned.spilled_handles == 0 and pinned.host_pulled_tokens == 0
    assert tiered.spilled_handles > 0
    # Later turns read histories that only the host tier still held.
    assert tiered.host_pulled_tokens > 0
    assert tiered.pulled_tokens > pinned.pulled_tokens
    # A demand waits for a copy where it would have waited for a release: no more turns wait.
    assert tiered.waited_turns <= pinned.waited_turns
    assert tiered.wrong_prefix_turns == 0 and tiered.wrong_prefix_tokens == 0


def test_a_full_host_tier_drops_spills_and_stays_within_its_size() -> None:
    small_host = replace(SMALL_D, decode_host_bytes=2 * GIB)
    summary = _run("kvplane", small_host)
    assert summary.spilled_handles > 0
    assert summary.releases.get("host_full", 0) > 0


def _two_conversations(
    b_arrival_s: float, copy_bytes_per_s: float, write_through: bool = False, copy_ahead: bool = True
) -> SimSummary:
    # D holds one turn's KV and half another's. Conversation a's retained 8,100 tokens leave too
    # little for b's turn: D's demand moves a's handle to host memory, and b starts once a's
    # accelerator blocks are free.
    costs = replace(SimCosts(), host_copy_bytes_per_s=copy_bytes_per_s)
    cluster = ClusterSpec(
        prefill_nodes=1,
        decode_nodes=1,
        decode_kv_capacity_bytes=costs.kv_bytes(13_500),
        decode_host_bytes=8 * GIB,
        decode_write_through=write_through,
        decode_copy_ahead=copy_ahead,
    )
    turns = [Turn(0.0, "a", 0, 8000, 100), Turn(b_arrival_s, "b", 0, 8000, 100)]
    return simulator_for(BASELINES["kvplane"], SimConfig(cluster=cluster, costs=costs)).run(turns).summary


def test_without_copies_ahead_a_demand_moves_a_handle_and_the_turn_waits_for_the_whole_copy() -> None:
    # a's handle stays on D's accelerators until b's turn needs them, about 3.3 s in; then it is
    # copied, 2.1 GB at 1 GB/s or at 25 GB/s, and b starts once the copy is whole.
    costs = SimCosts()
    slow_copy_s = replace(costs, host_copy_bytes_per_s=1e9).spill_s(costs.kv_bytes(8100))
    fast_copy_s = costs.spill_s(costs.kv_bytes(8100))
    for arrival_s in (3.0, 6.0):
        slow = _two_conversations(arrival_s, 1e9, copy_ahead=False)
        fast = _two_conversations(arrival_s, 25e9, copy_ahead=False)
        assert slow.waited_turns == fast.waited_turns == 1
        assert slow.spilled_handles >= 1 and fast.spilled_handles >= 1
        assert slow.ttft_p99_ms - fast.ttft_p99_ms == pytest.approx(
            (slow_copy_s - fast_copy_s) * 1000, rel=0.05
        )


def test_a_copy_ahead_lets_a_short_d_move_the_handle_at_once_or_wait_only_for_the_rest() -> None:
    # a's handle is published about 2.8 s in and copied ahead (2.1 s at 1 GB/s), staying on D's
    # accelerators. b, on D about 6.3 s in, has D move it to its whole copy at once: no wait; about
    # 3.3 s in, b waits for the rest of the copy only, not for a demand's answer and a whole copy.
    late = _two_conversations(6.0, 1e9)
    assert late.waited_turns == 0 and late.spilled_handles >= 1
    early = _two_conversations(3.0, 1e9)
    on_demand = _two_conversations(3.0, 1e9, copy_ahead=False)
    assert early.waited_turns == 1 and 400.0 < on_demand.ttft_p99_ms - early.ttft_p99_ms < 800.0
    # Without the copy ahead, b at 6.3 s waits for the demand's answer and the whole copy.
    assert _two_conversations(6.0, 1e9, copy_ahead=False).ttft_p99_ms > late.ttft_p99_ms + 2_000.0


def test_the_write_through_what_if_copies_at_publish_so_a_later_turn_finds_the_blocks_free() -> None:
    # a's handle is published about 2.8 s in and copied at once (2.1 s at 1 GB/s): b, on D about
    # 6.3 s in, finds a's accelerator blocks already free; about 3.3 s in, only the rest of the copy.
    assert _two_conversations(6.0, 1e9, write_through=True).waited_turns == 0
    early = _two_conversations(3.0, 1e9, write_through=True)
    on_demand = _two_conversations(3.0, 1e9, copy_ahead=False)
    # The copy started half a second before b's demand would have started it.
    assert early.waited_turns == 1 and 400.0 < on_demand.ttft_p99_ms - early.ttft_p99_ms < 600.0
    with pytest.raises(ValueError, match="write_through"):
        replace(SMALL_D, decode_write_through=True)  # no host tier
    with pytest.raises(ValueError, match="tiered"):
        SimSpec(workload="agentic", host_write_through=True)


def test_a_handle_no_turn_needs_stays_on_the_accelerators_until_the_leader_wants_its_blocks() -> None:
    # One turn; no one waits. The leader's value policy wants the handle's blocks once it is
    # min_age_s old (judged once a second): then it leaves the accelerators when its copy is whole.
    costs = SimCosts()
    cluster = _one_tiered_d(costs, 13_500)
    summary = (
        simulator_for(BASELINES["kvplane"], SimConfig(cluster=cluster))
        .run([Turn(0.0, "a", 0, 8000, 100)])
        .summary
    )
    assert summary.spilled_handles == 1
    held_gb = costs.kv_bytes(8100) / 1e9
    copy_s = costs.spill_s(costs.kv_bytes(8100))
    min_age_s = LowValue().min_age_s
    assert held_gb * min_age_s <= summary.retained_gb_s <= held_gb * (min_age_s + 1.0 + copy_s)


def test_a_conversation_back_after_ds_ttl_pulls_its_history_from_host_memory() -> None:
    # 600 s between turns: past D's 480 s TTL, within the host tier's hour.
    turns = [
        Turn(0.0, "c", 0, 8000, 100),
        Turn(600.0, "c", 1, 8600, 100, reused_prefix_tokens=8100, previous_context_tokens=8100),
    ]
    # P keeps no prefix cache (its KV events say so): only D's history can spare the recompute.
    no_cache = replace(SMALL_D, prefill_cache_bytes=0)
    pinned = simulator_for(BASELINES["kvplane-events"], SimConfig(cluster=no_cache)).run(turns).summary
    tiered_cluster = replace(no_cache, decode_host_bytes=64 * GIB)
    tiered = simulator_for(BASELINES["kvplane-events"], SimConfig(cluster=tiered_cluster)).run(turns).summary
    assert pinned.pulled_tokens == 0
    assert tiered.decisions.get("pull", 0) == 1 and tiered.host_pulled_tokens == tiered.pulled_tokens > 0
    # Offered only as long as D's TTL, the host copy would be of no use to it.
    short = SimConfig(cluster=replace(tiered_cluster, decode_host_ttl_s=480.0))
    assert simulator_for(BASELINES["kvplane-events"], short).run(turns).summary.pulled_tokens == 0
    # An hour later it is gone from there too.
    late = [turns[0], replace(turns[1], arrival_s=4000.0)]
    assert (
        simulator_for(BASELINES["kvplane-events"], SimConfig(cluster=tiered_cluster))
        .run(late)
        .summary.pulled_tokens
        == 0
    )


def test_llm_d_p2p_reads_from_a_peer_decode_nodes_host_tier_by_block_hash() -> None:
    cluster = replace(SMALL_D, decode_host_bytes=64 * GIB)
    p2p = _run("llm-d-p2p", cluster)
    affinity = _run("prefix-affinity", cluster)
    assert p2p.decisions.get("p2p_pull", 0) > 0
    assert p2p.host_pulled_tokens == p2p.pulled_tokens > 0
    assert p2p.reused_tokens > affinity.reused_tokens
    # Read by hash: never a wrong prefix; D keeps nothing on its accelerators.
    assert p2p.wrong_prefix_turns == 0 and p2p.retained_gb_s == 0


def test_llm_d_p2p_without_a_host_tier_is_prefix_affinity() -> None:
    turns = _turns()[:300]
    p2p = _run("llm-d-p2p", SMALL_D, turns)
    affinity = _run("prefix-affinity", SMALL_D, turns)
    assert p2p.decisions == affinity.decisions and p2p.ttft_p50_ms == affinity.ttft_p50_ms


def test_the_tiered_model_and_host_memory_go_together() -> None:
    with pytest.raises(ValueError, match="tiered"):
        SimSpec(workload="agentic", engine_model="tiered")
    with pytest.raises(ValueError, match="tiered"):
        SimSpec(workload="agentic", engine_model="pinned", host_gib_per_decode=64)
    assert "llm-d-p2p" not in SimSpec(workload="agentic").policies()
    assert (
        "llm-d-p2p" in SimSpec(workload="agentic", engine_model="tiered", host_gib_per_decode=64).policies()
    )


def test_the_command_refuses_p2p_without_a_host_tier(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--workload", "agentic", "--policies", "llm-d-p2p"])
    assert "needs --engine-model tiered" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workload", "agentic", "--engine-model", "tiered"])
    assert "--host-gib-per-decode" in capsys.readouterr().err


def test_a_full_host_tier_drops_what_the_leader_values_least_as_a_live_d_does() -> None:
    """The simulated control plane orders host drops as the leader's spill order orders a live
    D's: least expected reuse per byte first (here the younger handle, whose tenant comes back
    past D's TTL), not oldest first; the engine alone (no control plane) drops oldest first."""
    config = SimConfig(cluster=replace(SMALL_D, decode_host_bytes=8 * GIB))
    fleet = Fleet(config.cluster, config.costs, config.epoch_unix_ms, config.load_report_interval_s)
    d = fleet.decode[0]
    chain = BlockChain().extended(4, BlockIds())
    agent = SimHandle(1, "agents", "c-a", d, 64, 64 * 1024, chain, 100.0, 580.0)
    report = SimHandle(2, "reports", "c-r", d, 64, 64 * 1024, chain, 110.0, 590.0)
    plane = PipelineRetention(fleet, None)
    for i in range(300):
        plane.pipeline.values.gaps.observe_gap("agents", 2.0 + i % 60)
        plane.pipeline.values.gaps.observe_gap("reports", 7200.0 + i)
    assert plane.host_drop_order([agent, report], 115.0) == [report, agent]
    assert EngineOnly().host_drop_order([agent, report], 115.0) == [agent, report]


def _placed(sim: Simulator, handle_id: int, tier: str, nbytes: int) -> SimHandle:
    """A handle on D 0 of `sim`, 4 blocks long: in host memory ("host"), or on the accelerators
    with a whole copy ahead in host memory ("copy")."""
    d = sim.fleet.decode[0]
    handle = SimHandle(
        handle_id, "t", f"c-{handle_id}", d, 64, nbytes, BlockChain().extended(4, BlockIds()), 0.0, 480.0
    )
    sim._handles[handle_id] = d.handles[handle_id] = handle
    if tier == "host":
        handle.tier = "host"
        d.host_handles[handle_id] = handle
        d.host_retained += nbytes
    else:
        handle.copied_s = 0.0
        d.copies[handle_id] = handle
        d.host_copies += nbytes
        d.retained += nbytes
    return handle


def test_host_room_frees_host_tier_handles_before_it_gives_back_copies_ahead() -> None:
    """Room in D's host memory (for a move, or a new copy ahead) comes first from handles only
    the host tier holds, then from copies ahead of handles still in the KV cache: giving a copy
    back first would leave that handle's next move waiting for a whole copy."""
    nbytes = 1 << 20
    cluster = replace(SMALL_D, decode_host_bytes=3 * nbytes)
    sim = simulator_for(BASELINES["kvplane"], SimConfig(cluster=cluster))
    d = sim.fleet.decode[0]
    host = _placed(sim, 1, "host", nbytes)
    reading = _placed(sim, 2, "host", nbytes)
    reading.reading = True  # P is reading it: not dropped
    copied = _placed(sim, 3, "copy", nbytes)
    # Full: one handle's room is made by dropping the host-tier handle not being read.
    assert sim._host_room(d, nbytes, 10.0)
    assert not host.alive and 1 not in d.host_handles and sim.rec.releases["host_full"] == 1
    assert reading.alive and 3 in d.copies and copied.copied_s == 0.0
    # Full again (a new copy took the room): the only host-tier handle is being read, so the
    # copy ahead is given back; its handle lives on in the KV cache.
    d.host_copies += nbytes
    assert sim._host_room(d, nbytes, 10.0)
    assert 3 not in d.copies and copied.copied_s == float("inf")
    assert copied.alive and copied.tier == "gpu" and 3 in d.handles
    assert reading.alive and sim.rec.releases["host_full"] == 1
    # More than can be made: nothing is dropped or given back.
    assert not sim._host_room(d, 4 * nbytes, 10.0)
    assert reading.alive and d.host_retained == nbytes


def test_a_turn_larger_than_d_runs_once_d_holds_handles_only_in_host_memory() -> None:
    # b's prompt needs more blocks than D has. D runs it (overcommitted, as on an empty D) once
    # nothing runs there and a's handle has moved to host memory, which takes none of D's
    # accelerator blocks; it does not wait for that handle's host-tier TTL to end.
    costs = SimCosts()
    cluster = _one_tiered_d(costs, 10_000)
    turns = [Turn(0.0, "a", 0, 4000, 10), Turn(5.0, "b", 0, 12_000, 10)]
    sim = simulator_for(BASELINES["kvplane"], SimConfig(cluster=cluster, costs=costs))
    summary = sim.run(turns).summary
    assert summary.spilled_handles >= 1 and summary.overcommitted_turns == 1
    # b's first token comes within the demand's answer, the copy's landing and its own legs.
    assert max(sim.rec.ttft_s) < costs.spill_s(costs.kv_bytes(4010)) + 5.0
