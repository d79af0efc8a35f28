"""A sim-engine in-process publishes its prefix cache as vLLM does: vLLM's block hashes (what
`BlockHasher` predicts from token ids), prompt and decode-generated blocks, salts, sessions,
evictions and resets, read on real ZMQ sockets."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvplane.connector.simengine.engine import FinishInfo, GenerationRequest, SimEngine
from kvplane.connector.simengine.kv_cache_routes import kv_cache_routes
from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tests.support.kv_events import EventReader, ipc_dir
from tests.support.simengine import free_port, tokens

BS = 16


@pytest.fixture
def ipc() -> Iterator[str]:
    with ipc_dir() as d:
        yield d


@pytest.fixture
async def make_engine(ipc: str) -> AsyncIterator[Any]:
    """Starts engines publishing on ipc endpoints in a tmp dir; yields (engine, reader) pairs."""
    opened: list[tuple[SimEngine, EventReader]] = []

    async def make(**changes: Any) -> tuple[SimEngine, EventReader]:
        n = len(opened)
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"ipc://{ipc}/pub{n}",
            replay_endpoint=f"ipc://{ipc}/replay{n}",
            encoding=changes.pop("encoding", "map"),
        )
        base: dict[str, Any] = {
            "side_channel_port": free_port(),
            "block_size": BS,
            "num_blocks": 256,
            "bytes_per_block": 4096,
            "timing": TimingModel(speedup=50),
            "kv_events_config": events,
        }
        engine = SimEngine(SimEngineSettings(**(base | changes)))
        await engine.start()
        source = engine.settings.kv_events_source()
        assert source is not None
        reader = EventReader(source.endpoint, source.replay_endpoint)
        opened.append((engine, reader))
        await warm(engine, reader)
        return engine, reader

    yield make
    for engine, reader in opened:
        reader.close()
        await engine.stop()


async def warm(engine: SimEngine, reader: EventReader, timeout_s: float = 20) -> None:
    """Reset the (empty) cache until the subscription is live, then read every probe."""
    assert engine.kv_events is not None
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(reader.sub.poll, 100):  # a poll with a deadline
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        assert engine.reset_prefix_cache()
    await published(engine, reader)


async def published(engine: SimEngine, reader: EventReader) -> list[KVEvent]:
    """The events of every batch the engine has numbered so far (read live, in order)."""
    await asyncio.sleep(0)  # the engine flushes a turn's events in its next loop iteration
    assert engine.kv_events is not None
    last = engine.kv_events.next_seq - 1
    batches = await asyncio.to_thread(reader.drain_until, lambda b: b.seq >= last)
    return [e for b in batches for e in b.decoded.events]


async def run(
    engine: SimEngine,
    prompt: list[int],
    max_tokens: int,
    cache_salt: str | None = None,
    session_id: str | None = None,
) -> FinishInfo:
    req = GenerationRequest(
        f"cmpl-{uuid.uuid4().hex}",
        tuple(prompt),
        max_tokens,
        True,
        cache_salt=cache_salt,
        session_id=session_id,
    )
    fin = None
    async for ev in engine.generate(req):
        fin = ev.finish or fin
    assert fin is not None
    return fin


def stored(events: list[KVEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


async def test_prompt_and_decode_generated_blocks_carry_the_hashes_vllm_computes(make_engine: Any) -> None:
    engine, reader = await make_engine()
    prompt = tokens(1, 5 * BS + 3)
    fin = await run(engine, prompt, 40)
    events = await published(engine, reader)
    hasher = BlockHasher(BS)
    at_prefill, at_finish = stored(events)
    assert at_prefill == BlockStored(
        block_ids=tuple(hasher.ids(prompt)),
        parent_id=None,
        token_ids=tuple(prompt[: 5 * BS]),
        block_size=BS,
        medium="GPU",
        extra_keys=(None,) * 5,
        group_idx=0,
        session_id=None,
    )
    # The last sampled token has no KV yet: blocks of every token before it.
    everything = hasher.ids(prompt + list(fin.output_token_ids)[:-1])
    assert len(everything) == 7
    assert at_finish.block_ids == tuple(everything[5:]) and at_finish.parent_id == everything[4]
    assert at_finish.token_ids == tuple((prompt + list(fin.output_token_ids))[5 * BS : 7 * BS])


async def test_a_salted_request_hashes_its_first_block_with_the_salt_and_names_its_session(
    make_engine: Any,
) -> None:
    engine, reader = await make_engine()
    prompt = tokens(2, 3 * BS)
    await run(engine, prompt, 1, cache_salt="tenant-a", session_id="conv-42")
    (salted,) = stored(await published(engine, reader))
    hasher = BlockHasher(BS)
    assert salted.block_ids == tuple(hasher.ids(prompt, cache_salt="tenant-a"))
    assert salted.block_ids != tuple(hasher.ids(prompt))
    assert salted.extra_keys == (["tenant-a"], None, None), "vLLM publishes the salt untagged, on block 0"
    assert salted.session_id == "conv-42"
    # Another salt shares nothing: the same prompt is stored again under its own hashes.
    await run(engine, prompt, 1)
    (plain,) = stored(await published(engine, reader))
    assert plain.block_ids == tuple(hasher.ids(prompt)) and plain.session_id is None


async def test_a_prefix_hit_stores_only_the_new_blocks_after_their_parent(make_engine: Any) -> None:
    engine, reader = await make_engine(encoding="array")
    first = tokens(3, 3 * BS + 5)
    await run(engine, first, 1)
    await published(engine, reader)
    second = first + tokens(4, 40)
    await run(engine, second, 1)
    (new,) = stored(await published(engine, reader))
    ids = BlockHasher(BS).ids(second)
    assert new.block_ids == tuple(ids[3:]) and new.parent_id == ids[2]
    assert new.token_ids == tuple(second[3 * BS : 5 * BS])


async def test_an_evicted_block_is_removed_by_its_hash(make_engine: Any) -> None:
    engine, reader = await make_engine(num_blocks=8)
    first = tokens(5, 4 * BS)
    await run(engine, first, 1)
    await published(engine, reader)
    await run(engine, tokens(6, 6 * BS), 1)  # needs two of the first request's cached blocks
    events = await published(engine, reader)
    removed = [i for e in events if isinstance(e, BlockRemoved) for i in e.block_ids]
    assert all(isinstance(e, BlockRemoved) and e.medium == "GPU" for e in events[:2])
    assert sorted(removed) == sorted(BlockHasher(BS).ids(first)[:2]), "the least recently freed go first"
    assert stored(events)[0].block_ids == tuple(BlockHasher(BS).ids(tokens(6, 6 * BS)))


async def test_a_reset_publishes_all_blocks_cleared_and_is_refused_while_blocks_are_in_use(
    make_engine: Any,
) -> None:
    engine, reader = await make_engine()
    before = engine.kv_events.next_seq
    req = GenerationRequest("cmpl-running", tuple(tokens(7, 2 * BS)), 50, True)
    gen = engine.generate(req)
    await gen.__anext__()
    assert not engine.reset_prefix_cache(), "a running request holds blocks, as in vLLM"
    await gen.aclose()
    await published(engine, reader)
    assert engine.reset_prefix_cache()
    events = await published(engine, reader)
    assert events[-1] == AllBlocksCleared()
    assert not any(isinstance(e, BlockRemoved) for e in events), "a reset is one event, not one per block"
    assert engine.kv_events.next_seq > before


async def test_sha256_cbor_engines_publish_cbor_hashes(make_engine: Any) -> None:
    engine, reader = await make_engine(prefix_caching_hash_algo="sha256_cbor")
    prompt = tokens(8, 2 * BS)
    await run(engine, prompt, 1)
    (event,) = stored(await published(engine, reader))
    assert event.block_ids == tuple(BlockHasher(BS, "sha256_cbor").ids(prompt))
    assert event.block_ids != tuple(BlockHasher(BS).ids(prompt))


async def test_events_are_off_unless_configured_and_their_hooks_then_refuse() -> None:
    engine = SimEngine(SimEngineSettings(side_channel_port=free_port()))
    assert engine.kv_events is None and engine.settings.kv_events_source() is None
    app = web.Application()
    app.add_routes(kv_cache_routes(engine))
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/sim/kv_events/pause")
        assert response.status == 409
        response = await client.post("/reset_prefix_cache")
        assert await response.json() == {"success": True}, "an idle cache resets with events off too"
