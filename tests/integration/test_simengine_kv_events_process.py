"""A sim-engine process publishing KV events as vLLM does, driven over HTTP: the X-Session-ID
header, the fault hooks (a dropped batch the replay fills, a paused stream), vLLM's
/reset_prefix_cache, and a restart that numbers from 0 again."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import AllBlocksCleared, BlockStored
from tests.support.kv_events import EventReader, ipc_dir
from tests.support.simengine import MODEL, Engine, sim, start_engine, stop_engine, tokens, wait_healthy

BS = 16


@pytest.fixture
def ipc() -> Iterator[str]:
    with ipc_dir() as d:
        yield d


def post(engine: Engine, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(
        engine.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def complete(engine: Engine, prompt: list[int], headers: dict[str, str] | None = None) -> None:
    post(engine, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}, headers)


def next_seq(engine: Engine) -> int:
    return int(engine.state()["kv_events"]["next_seq"])


def warm(engine: Engine, reader: EventReader) -> int:
    """Reset the idle engine's cache until the subscription is live; the next batch's number."""
    return reader.warm(lambda: post(engine, "/reset_prefix_cache", {}), lambda: next_seq(engine))


def started(tmp_path: Path, ipc: str) -> tuple[Engine, EventReader]:
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{ipc}/pub",
        replay_endpoint=f"ipc://{ipc}/replay",
        encoding="array",
        topic="kv",
    )
    settings = sim(kv_events_config=events)
    engine = start_engine("sim", tmp_path, settings)
    try:
        wait_healthy(engine)
    except BaseException:
        stop_engine(engine)
        raise
    source = settings.kv_events_source()
    assert source is not None
    return engine, EventReader(source.endpoint, source.replay_endpoint)


def test_sessions_fault_hooks_reset_and_restart_over_http(tmp_path: Path, ipc: str) -> None:
    engine, reader = started(tmp_path, ipc)
    try:
        seq = warm(engine, reader)
        prompt = tokens(1, 3 * BS)
        complete(engine, prompt, {"X-Session-ID": "conv-7"})
        (batch,) = reader.drain_until(lambda b: b.seq == seq)
        (event,) = batch.decoded.events
        assert isinstance(event, BlockStored) and event.session_id == "conv-7"
        assert event.block_ids == tuple(BlockHasher(BS).ids(prompt)) and batch.topic == b"kv"

        # A dropped batch: the live stream skips its number, the replay has it.
        assert post(engine, "/sim/kv_events/drop", {"batches": 1})["dropping"] == 1
        lost, kept = tokens(2, 2 * BS), tokens(3, 2 * BS)
        complete(engine, lost)
        complete(engine, kept)
        assert reader.next().seq == seq + 2
        gap = reader.replay(seq + 1)
        assert [b.seq for b in gap] == [seq + 1, seq + 2]
        assert gap[0].decoded.events[0].block_ids == tuple(BlockHasher(BS).ids(lost))  # type: ignore[union-attr]

        # A paused stream: the batch waits, unsent and unbuffered, and goes out on resume.
        assert post(engine, "/sim/kv_events/pause", {})["paused"] is True
        complete(engine, tokens(4, 2 * BS))
        assert engine.state()["kv_events"]["queued"] == 1
        assert reader.replay(seq + 3) == []
        assert post(engine, "/sim/kv_events/resume", {})["paused"] is False
        assert reader.next().seq == seq + 3

        assert post(engine, "/reset_prefix_cache", {}) == {"success": True}
        assert reader.next().decoded.events == (AllBlocksCleared(),)
    finally:
        stop_engine(engine)
        reader.close()

    restarted, reader = started(tmp_path, ipc)
    try:
        first_live = warm(restarted, reader)
        replayed = reader.replay(0)
        assert [b.seq for b in replayed] == list(range(first_live)), "a new start numbers from 0"
        assert all(b.decoded.events == (AllBlocksCleared(),) for b in replayed), "nothing of the last run"
    finally:
        stop_engine(restarted)
        reader.close()


def test_bad_fault_hook_requests_are_refused(tmp_path: Path, ipc: str) -> None:
    engine, reader = started(tmp_path, ipc)
    reader.close()
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(engine, "/sim/kv_events/drop", {"batches": -1})
        assert refused.value.code == 400
    finally:
        stop_engine(engine)
