"""D's moves of retained handles to vLLM's CPU offloading tier, on their own: which handles move
and for what prefix, when their GPU blocks may go, and when a moved handle ends. (Inside real
vLLM scheduler classes: tests/unit/test_vllm_connector_offloading.py.)"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from kvplane.connector.digests import digest_tokens
from kvplane.connector.vllm_host_tier import HostTier, parse_endpoint
from kvplane.services.common.model.block_hashes import external_id
from kvplane.services.common.model.handles import KEY_REMOTE_KV_SOURCE, CacheHandle, KvTier
from tests.unit.routing_policy_fixtures import NOW, mk_handle, mk_node

BLOCK = 16
BYTES_PER_BLOCK = 4096


def hashes(n: int, seed: str) -> list[bytes]:
    """Stand-ins for vLLM's block hashes of a request: distinct 32-byte values."""
    return [hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(n)]


class Cpu:
    """What the CPU tier holds: block id -> depth, as the node agent's block set would say."""

    def __init__(self) -> None:
        self.depth: dict[int, int] = {}

    def hold(self, block_hashes: list[bytes], count: int) -> None:
        for depth, h in enumerate(block_hashes[:count], start=1):
            self.depth[external_id(h)] = depth

    def held_prefix(self, block_ids: object) -> int:
        n = 0
        for n, block_id in enumerate(block_ids, start=1):  # type: ignore[call-overload]
            if self.depth.get(block_id) != n:
                return n - 1
        return n


def tier_with(cpu: Cpu, ttl_s: float = 3600.0) -> HostTier:
    return HostTier(("10.0.0.5", 5700), BLOCK, BYTES_PER_BLOCK, cpu.held_prefix, ttl_s, lambda: NOW)


def published(
    tier: HostTier, request_id: str, tokens: int, seed: str
) -> tuple[CacheHandle, list[int], list[bytes]]:
    node = mk_node("d0")
    retained = list(range(1000 + len(seed), 1000 + len(seed) + tokens))
    handle = replace(mk_handle(node, retained), handle_id=f"h-{request_id}")
    handle = replace(handle, vllm=replace(handle.vllm, remote_request_id=request_id))
    block_hashes = hashes(tokens // BLOCK + 1, seed)  # vLLM hashes the sampled token's block too
    tier.track(request_id, handle, retained, block_hashes)
    return handle, retained, block_hashes


def test_moves_the_oldest_handles_for_the_prefix_the_cpu_tier_holds() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    first, retained, first_hashes = published(tier, "r-a", 100 * BLOCK, "a")
    _, _, second_hashes = published(tier, "r-b", 50 * BLOCK, "b")
    cpu.hold(first_hashes, 60)
    cpu.hold(second_hashes, 50)
    moves = tier.spill(blocks_wanted=10)
    assert [r for r, _ in moves] == ["r-a"]  # the oldest covers the want: one move
    ((_, moved),) = moves
    assert moved.tier is KvTier.HOST and moved.relocates_handle_id == first.handle_id
    assert moved.handle_id != first.handle_id
    assert moved.vllm.remote_block_ids == () and moved.vllm.remote_num_tokens == 60 * BLOCK
    assert moved.digests == digest_tokens(retained[: 60 * BLOCK], BLOCK)
    assert moved.retained_bytes == 60 * BYTES_PER_BLOCK
    assert moved.vllm.extra[KEY_REMOTE_KV_SOURCE] == {"remote_host": "10.0.0.5", "remote_port": 5700}
    # The device handle's GPU blocks are what the move frees, once stored.
    assert tier.moving_blocks() == first.vllm.num_blocks
    # A move in flight is not sent again; the next want goes to the next handle.
    assert [r for r, _ in tier.spill(blocks_wanted=200)] == ["r-b"]


def test_moves_follow_the_control_planes_order_then_age() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    for request_id in ("r-a", "r-b", "r-c"):
        _, _, block_hashes = published(tier, request_id, 20 * BLOCK, request_id)
        cpu.hold(block_hashes, 20)
    tier.set_order(["r-c", "r-gone"], ["r-host"])  # the leader values the youngest least
    assert [r for r, _ in tier.spill(blocks_wanted=1)] == ["r-c"]
    assert [r for r, _ in tier.spill(blocks_wanted=30)] == ["r-a", "r-b"], "then oldest first"


def test_a_moved_handle_is_offered_for_the_host_ttl_from_its_publish_on_both_clocks() -> None:
    cpu = Cpu()
    tier = tier_with(cpu, ttl_s=900)
    first, _, block_hashes = published(tier, "r-a", 20 * BLOCK, "a")
    cpu.hold(block_hashes, 20)
    [(_, moved)] = tier.spill(blocks_wanted=1)
    assert moved.wall_expiry_unix_ms == NOW + 900_000
    longer_s = (moved.wall_expiry_unix_ms - first.wall_expiry_unix_ms) / 1000
    was, now = first.vllm.remote_blocks_expiry_time, moved.vllm.remote_blocks_expiry_time
    assert was is not None and now is not None
    assert now - was == pytest.approx(longer_s)

    short = tier_with(cpu, ttl_s=0)
    first, _, _ = published(short, "r-a", 20 * BLOCK, "a")
    [(_, moved)] = short.spill(blocks_wanted=1)
    assert moved.wall_expiry_unix_ms == first.wall_expiry_unix_ms, "never shorter than the device handle's"


def test_a_handle_whose_first_block_the_cpu_tier_lacks_never_moves() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    _, _, block_hashes = published(tier, "r-a", 20 * BLOCK, "a")
    cpu.hold(block_hashes[1:], 10)  # depths 1.. on the wrong blocks: not this chain's prefix
    assert tier.spill(blocks_wanted=5) == []
    assert tier.moving_blocks() == 0


def test_a_move_command_moves_the_handle_it_names_once_and_refuses_one_without_cpu_copies() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    for request_id in ("r-a", "r-b", "r-bare"):
        _, _, block_hashes = published(tier, request_id, 20 * BLOCK, request_id)
        if request_id != "r-bare":
            cpu.hold(block_hashes, 20)
    assert tier.refuses_move("r-b") == ""
    moved = tier.move("r-b")
    assert moved is not None and moved.vllm.remote_request_id == "r-b", "the named, not the oldest"
    assert tier.move("r-b") is None, "a move in flight is not made again"
    assert "no block" in tier.refuses_move("r-bare") and tier.move("r-bare") is None
    assert tier.refuses_move("r-never-held") == "" and tier.move("r-never-held") is None


def test_gpu_blocks_go_only_when_the_move_is_stored_and_a_refused_handle_is_not_tried_again() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    for request_id in ("r-a", "r-b"):
        _, _, block_hashes = published(tier, request_id, 20 * BLOCK, request_id)
        cpu.hold(block_hashes, 20)
    assert [r for r, _ in tier.spill(blocks_wanted=100)] == ["r-a", "r-b"]
    assert tier.settled() == ([], [])  # nothing answered yet: nothing to free
    tier.outcome("r-a")(True)
    tier.outcome("r-b")(False)
    assert tier.settled() == (["r-a"], ["r-b"])
    assert tier.is_moved("r-a") and not tier.is_moved("r-b")
    assert tier.moving_blocks() == 0
    assert tier.spill(blocks_wanted=100) == []  # r-b was checked out or released: left alone
    # An outcome for a move whose blocks were freed meanwhile changes nothing.
    published(tier, "r-c", 20 * BLOCK, "r-c")
    cpu.hold(hashes(21, "r-c"), 20)
    tier.spill(blocks_wanted=1)
    tier.forget("r-c")  # read or expired first
    tier.outcome("r-c")(True)
    assert tier.settled() == ([], []) and not tier.is_moved("r-c")


def test_a_moved_handle_ends_once_when_its_first_block_leaves_the_cpu_tier_or_it_expires() -> None:
    cpu = Cpu()
    tier = tier_with(cpu)
    handles = {}
    for request_id in ("r-a", "r-b", "r-c"):
        handles[request_id], _, block_hashes = published(tier, request_id, 20 * BLOCK, request_id)
        cpu.hold(block_hashes, 20)
        tier.spill(blocks_wanted=1)
        tier.outcome(request_id)(True)
    tier.settled()
    assert len(tier) == 3
    del cpu.depth[external_id(hashes(1, "r-a")[0])]
    assert tier.ended(NOW) == ["r-a"]
    assert tier.ended(NOW) == []
    assert tier.release("r-b") and not tier.release("r-b")
    # Moved, it is offered for the host tier's TTL from its publish, not the device handle's life.
    assert tier.ended(handles["r-c"].wall_expiry_unix_ms) == []
    assert tier.ended(NOW + 3_600_000) == ["r-c"]
    assert len(tier) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.5:5700", ("10.0.0.5", 5700)), ("[::1]:5700", ("::1", 5700)), ("d-0.svc:1", ("d-0.svc", 1))],
)
def test_endpoints_parse(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["", "10.0.0.5", ":5700", "host:0", "host:65536", "host:port"])
def test_bad_endpoints_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(text)
