"""The sim-engine's remote loads on their own: a reader pulls a holder's blocks over real NIXL (UCX on
loopback) after a real side-channel handshake, or says why it recomputes, and always lets the holder
free what it no longer needs."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvplane.connector.simengine.block_content import full_block_hashes, root_hash
from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.kv_params import RemoteBlocks, parse_remote
from kvplane.connector.simengine.metrics import SimEngineMetrics
from kvplane.connector.simengine.nixl_transport import NixlTransport
from kvplane.connector.simengine.remote_loads import RemoteLoads
from kvplane.connector.simengine.retention import Retention
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.side_channel import LocalIdentity, SideChannelServer
from kvplane.services.common.runtime.ports import free_port
from tests.support.polling import eventually

BS = 16
THRESHOLD = 32
HISTORY = [1000 + i for i in range(4 * BS)]  # what the holder retains: 4 whole blocks


def settings(**changes: Any) -> SimEngineSettings:
    base: dict[str, Any] = dict(
        block_size=BS,
        num_blocks=32,
        bytes_per_block=256,
        kv_recompute_threshold=THRESHOLD,
        expiry_guard_s=2.0,
    )
    return SimEngineSettings(**(base | changes))


class Peer:
    """One engine's KV side: its pool, NIXL agent, side channel, retention and remote loads."""

    def __init__(self, engine_id: str, s: SimEngineSettings, incarnation: str = "life-1") -> None:
        self.engine_id, self.incarnation, self.settings = engine_id, incarnation, s
        self.pool = BlockPool(s.num_blocks, s.bytes_per_block, BS, root_hash(s.model))
        self.metrics = SimEngineMetrics(s.model)
        self.transport: NixlTransport | None = NixlTransport(f"{engine_id}:{incarnation}", self.pool)
        self.side_channel = SideChannelServer(self._identity, "127.0.0.1", free_port())
        self.retention = Retention(s, self.pool, self.metrics, self)
        self.loads = RemoteLoads(s, self.pool, self.metrics, lambda: self.transport)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def side_channel_port(self) -> int:
        return self.side_channel.port

    def _identity(self) -> LocalIdentity:
        assert self.transport is not None
        s = self.settings
        return LocalIdentity(
            self.engine_id, self.incarnation, s.model, BS, s.bytes_per_block, s.num_blocks, 0,
            self.transport.metadata(), self.transport.serialized_descs(),
        )  # fmt: skip

    async def start(self) -> None:
        assert self.transport is not None
        self.retention.bind(asyncio.get_running_loop())
        await self.side_channel.start()
        self._tasks = [asyncio.create_task(self.retention.notification_loop(self.transport))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.side_channel.stop()
        if self.transport is not None:
            self.transport.close()

    def retain(self, tokens: list[int], request_id: str = "h1") -> RemoteBlocks:
        """A finished D turn over `tokens`, kept as a handle; the handle as a reader parses it."""
        blocks = self.pool.allocate(-(-len(tokens) // BS))
        self.pool.write_tokens(blocks, tokens, len(tokens))
        params = self.retention.keep(request_id, "decode_handle", blocks, len(tokens), tokens, 0, {})
        assert params is not None
        remote = parse_remote(params)
        assert remote is not None
        return remote

    async def load(
        self, leg: Any, remote: RemoteBlocks, prompt: list[int], hit_blocks: int = 0
    ) -> tuple[str, int]:
        blocks = self.pool.allocate(-(-len(prompt) // BS))
        chain = full_block_hashes(prompt, BS, self.pool.root)
        outcome = await self.loads.load(leg, remote, prompt, chain, blocks, hit_blocks)
        return outcome.outcome, outcome.external_tokens

    def handshakes(self, outcome: str) -> float:
        labels = {"model_name": self.settings.model, "engine": "0", "outcome": outcome}
        return self.metrics.registry.get_sample_value("kvplane_sim_handshakes_total", labels) or 0.0

    def freed_by_read(self) -> float:
        labels = {"model_name": self.settings.model, "engine": "0", "kind": "decode_handle", "reason": "read"}
        return self.metrics.registry.get_sample_value("kvplane_sim_retained_frees_total", labels) or 0.0


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Peer, Peer]]:
    holder, reader = Peer("sim-decode-0", settings()), Peer("sim-prefill-0", settings())
    await holder.start()
    await reader.start()
    try:
        yield holder, reader
    finally:
        await reader.stop()
        await holder.stop()


async def _freed(holder: Peer) -> None:
    async def gone() -> bool:
        return holder.retention.count == 0

    await eventually(gone, what="the holder to free its handle on the reader's notification")


async def test_a_prefill_pulls_the_history_it_lacks_and_the_holder_frees_it_once_read(
    pair: tuple[Peer, Peer],
) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    prompt = [*HISTORY, 7, 8, 9]
    assert await reader.load("prefill", remote, prompt) == ("pulled", len(HISTORY))
    await _freed(holder)
    assert holder.freed_by_read() == 1 and holder.side_channel.handshakes_served == 1


async def test_a_decode_pulls_the_whole_prompt_beyond_its_own_cache(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    # D's own cache holds the first block: only the three after it move.
    assert await reader.load("decode", remote, list(HISTORY), hit_blocks=1) == ("pulled", len(HISTORY) - BS)


async def test_pulled_blocks_that_are_not_the_prompts_are_never_used(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    other = [t + 1 for t in HISTORY]
    assert await reader.load("prefill", remote, [*other, 1]) == ("verify_failed", 0)


@pytest.mark.parametrize(
    ("hit_blocks", "extra", "outcome"),
    [(4, [], "nothing_missing"), (3, [1, 2], "recompute_threshold")],
    ids=["all cached", "below the threshold"],
)
async def test_a_load_not_worth_making_still_lets_the_holder_free_its_handle(
    pair: tuple[Peer, Peer], hit_blocks: int, extra: list[int], outcome: str
) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    assert await reader.load("prefill", remote, [*HISTORY, *extra], hit_blocks=hit_blocks) == (outcome, 0)
    await _freed(holder)


async def test_a_handle_about_to_expire_is_declined_and_freed(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    assert remote.expiry_time is not None
    soon = dataclasses.replace(
        remote, expiry_time=remote.expiry_time - holder.settings.decoder_kv_blocks_ttl + 1.0
    )
    assert await reader.load("prefill", soon, [*HISTORY, 1]) == ("declined_expiry", 0)
    await _freed(holder)


async def test_a_handle_naming_more_blocks_than_it_lists_is_refused(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    short = dataclasses.replace(remote, block_ids=remote.block_ids[:2])
    assert await reader.load("prefill", short, [*HISTORY, 1]) == ("too_few_remote_blocks", 0)


async def test_a_handle_of_the_holders_previous_life_is_stale(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    old = dataclasses.replace(remote, incarnation="life-0")
    assert await reader.load("prefill", old, [*HISTORY, 1]) == ("stale_incarnation", 0)
    assert holder.retention.count == 1, "the live handle is untouched"


async def test_a_holder_of_another_model_or_geometry_is_incompatible() -> None:
    holder, reader = Peer("sim-decode-0", settings(model="other")), Peer("sim-prefill-0", settings())
    await holder.start()
    await reader.start()
    try:
        remote = holder.retain(HISTORY)
        assert await reader.load("prefill", remote, [*HISTORY, 1]) == ("incompatible", 0)
    finally:
        await reader.stop()
        await holder.stop()


async def test_a_holder_that_cannot_be_reached_or_is_another_engine_fails_the_handshake(
    pair: tuple[Peer, Peer],
) -> None:
    holder, reader = pair
    remote = holder.retain(HISTORY)
    nobody = dataclasses.replace(remote, port=free_port())
    assert await reader.load("prefill", nobody, [*HISTORY, 1]) == ("handshake_failed", 0)
    impostor = dataclasses.replace(remote, engine_id="sim-decode-9")
    assert await reader.load("prefill", impostor, [*HISTORY, 1]) == ("handshake_failed", 0)
    assert reader.handshakes("failed") == 2 and reader.handshakes("ok") == 0


async def test_a_peer_is_kept_until_the_holder_restarts(pair: tuple[Peer, Peer]) -> None:
    holder, reader = pair
    first = holder.retain(HISTORY, "h1")
    second = holder.retain(HISTORY, "h2")
    assert (await reader.load("prefill", first, [*HISTORY, 1]))[0] == "pulled"
    assert (await reader.load("prefill", second, [*HISTORY, 1]))[0] == "pulled"
    assert holder.side_channel.handshakes_served == 1, "one handshake per holder"
    # The same address and engine id, a new life: the reader handshakes again before trusting it.
    holder.incarnation = "life-2"
    third = holder.retain(HISTORY, "h3")
    assert (await reader.load("prefill", third, [*HISTORY, 1]))[0] == "pulled"
    assert holder.side_channel.handshakes_served == 2
