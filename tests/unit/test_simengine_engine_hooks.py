"""The seam between a sim-engine and the node agent: an engine without a control plane observes
nothing and changes nothing, and the engine offers the agent every `EngineControl` command."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.engine_hooks import EngineControl, EngineLoad, EngineObserver, NullObserver
from kvplane.connector.simengine.settings import SimEngineSettings


def _members(protocol: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(protocol) if not name.startswith("_")}


def test_the_null_observer_is_an_observer_that_leaves_every_param_as_it_was() -> None:
    observer: EngineObserver = NullObserver()
    assert _members(EngineObserver) <= _members(NullObserver)
    params: dict[str, Any] = {"remote_num_tokens": 64, "remote_block_ids": [[1, 2, 3, 4]]}
    observer.check_pull(params, [1, 2, 3])
    observer.on_handle_retained(params, [1, 2, 3], 4096, {"kvplane_tenant": "t"})
    observer.on_blocks_freed("r1", True)
    assert params == {"remote_num_tokens": 64, "remote_block_ids": [[1, 2, 3, 4]]}


def test_an_engine_without_a_control_plane_gets_the_null_observer() -> None:
    assert isinstance(SimEngine(SimEngineSettings(num_blocks=8)).observer, NullObserver)


def test_the_engine_answers_every_command_the_agent_may_send() -> None:
    engine: EngineControl = SimEngine(SimEngineSettings(num_blocks=8), incarnation="life-1")
    assert all(hasattr(engine, name) for name in _members(EngineControl))
    assert engine.incarnation == "life-1"
    assert engine.load() == EngineLoad(
        queued_requests=0,
        queued_prefill_tokens=0,
        running_requests=0,
        free_kv_blocks=8,
        total_kv_blocks=8,
        retained_bytes=0,
        retained_handles=0,
    )
    assert engine.release_early("never-held") is False
    engine.drain()
    assert engine.load().retained_handles == 0


def test_a_load_snapshot_is_a_frozen_value() -> None:
    load = EngineLoad(1, 2, 3, 4, 5, 6, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.running_requests = 0  # type: ignore[misc]
    assert load == EngineLoad(1, 2, 3, 4, 5, 6, 7)
