"""The sim-engine's NIXL transport on its own: two agents in one process, UCX over loopback. A READ
moves the remote blocks' bytes into the local ones and then delivers its notification; bad requests
fail with the transport's own errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.nixl_transport import NixlTransport, RemoteAgent, TransferFailedError

BLOCKS = 8
BLOCK_BYTES = 256


@dataclass
class Inbox:
    """The holder's notifications. Polling is what drives each agent's side of UCX (they run
    without a progress thread), so both poll all along, as each engine's notification loop does."""

    holder: NixlTransport
    reader: NixlTransport
    got: list[tuple[str, bytes]] = field(default_factory=list)

    async def poll(self) -> None:
        while True:
            self.got += self.holder.poll_notifs()
            assert self.reader.poll_notifs() == [], "the reader is never notified"
            await asyncio.sleep(0.005)

    async def wait(self, count: int, timeout_s: float = 10.0) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {count} notification(s); got {self.got}")
            await asyncio.sleep(0.01)
        return self.got


Agents = tuple[NixlTransport, BlockPool, NixlTransport, BlockPool, Inbox]


@pytest.fixture
async def agents() -> AsyncIterator[Agents]:
    holder_pool, reader_pool = BlockPool(BLOCKS, BLOCK_BYTES, 16, 1), BlockPool(BLOCKS, BLOCK_BYTES, 16, 1)
    holder, reader = NixlTransport("holder:1", holder_pool), NixlTransport("reader:1", reader_pool)
    inbox = Inbox(holder, reader)
    polling = asyncio.create_task(inbox.poll())
    try:
        yield holder, holder_pool, reader, reader_pool, inbox
    finally:
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        reader.close()
        holder.close()


def _add(reader: NixlTransport, holder: NixlTransport) -> RemoteAgent:
    return reader.add_remote(holder.metadata(), holder.serialized_descs(), BLOCKS)


async def test_a_read_moves_scattered_remote_blocks_and_then_notifies_the_holder(
    agents: Agents,
) -> None:
    holder, holder_pool, reader, reader_pool, inbox = agents
    for b in (5, 6):
        holder_pool.block(b)[:] = np.arange(holder_pool.content.words, dtype=np.uint64) + np.uint64(b * 1000)
    remote = _add(reader, holder)
    seconds = await reader.read(remote, [0, 3], [5, 6], b'{"request_id": "h1"}', timeout_s=10.0)
    assert seconds >= 0
    assert np.array_equal(reader_pool.block(0), holder_pool.block(5))
    assert np.array_equal(reader_pool.block(3), holder_pool.block(6))
    assert not np.array_equal(reader_pool.block(1), holder_pool.block(5)), "only the named blocks are written"
    assert await inbox.wait(1) == [("reader:1", b'{"request_id": "h1"}')]


async def test_a_notification_goes_without_a_read(agents: Agents) -> None:
    holder, _, reader, _, inbox = agents
    reader.send_notif(_add(reader, holder), b"done")
    assert await inbox.wait(1) == [("reader:1", b"done")]


async def test_a_read_outside_the_holders_pool_or_of_unequal_lists_is_refused(
    agents: Agents,
) -> None:
    holder, _, reader, _, inbox = agents
    remote = _add(reader, holder)
    with pytest.raises(TransferFailedError, match="out of range"):
        await reader.read(remote, [0], [BLOCKS], b"", timeout_s=5.0)
    with pytest.raises(ValueError, match="differ in length"):
        await reader.read(remote, [0, 1], [2], b"", timeout_s=5.0)
    reader.send_notif(remote, b"after")
    assert await inbox.wait(1) == [("reader:1", b"after")], "a refused read notifies no one"


async def test_a_removed_peer_can_no_longer_be_notified_and_removing_it_twice_is_harmless(
    agents: Agents,
) -> None:
    holder, _, reader, _, inbox = agents
    remote = _add(reader, holder)
    reader.remove_remote(remote)
    reader.remove_remote(remote)
    with pytest.raises(TransferFailedError):
        reader.send_notif(remote, b"late")
    again = _add(reader, holder)
    reader.send_notif(again, b"back")
    assert await inbox.wait(1) == [("reader:1", b"back")], "a peer can be added again"
