"""The node agent through control-plane faults: a metadata service killed and restarted within
the node's lease costs the node nothing (no new registration, no purge, no release), and a
publish that keeps failing is given up after its deadline instead of being retried for good.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aetcd import rpc

from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.processes import ManagedProcess, StartupError, grpc_health_probe
from kvplane.services.process import ServiceProcess
from tests.conftest import AUTH_ENV, MESH_CREDENTIALS, make_node
from tests.support.eviction_nodes import start_purging_leader
from tests.support.factories import make_handle
from tests.support.polling import eventually

# Long enough to outlive a restart of the metadata service on a loaded machine.
LEASE_TTL_S = 20


class Engine:
    """The engine side: which request ids the agent told it to free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.freed: list[str] = []

    def on_release(self, request_id: str) -> None:
        with self._lock:
            self.freed.append(request_id)


class Metadata:
    """`kvplane serve metadata` as its own process, on a fixed port, so it can be killed."""

    def __init__(self, etcd: LocalEtcd, prefix: str, run_dir: Path) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        config = run_dir / "metadata.json"
        config.write_text(
            json.dumps(
                {
                    "etcd": {"endpoints": [etcd.endpoint], "prefix": prefix, "request_timeout_s": 1.0},
                    "telemetry": {"metrics_port": 0, "json_logs": False},
                }
            )
        )
        self.process = ManagedProcess(
            "metadata",
            [
                *(sys.executable, "-m", "kvplane.services.cli", "serve", "metadata"),
                *("--config", str(config), "--listen", self.target, "--metrics-port", "0"),
            ],
            run_dir / "metadata.log",
            env=AUTH_ENV,
        )

    async def start(self) -> None:
        self.process.start()
        ready = grpc_health_probe(self.target)

        async def up() -> bool:
            if not self.process.alive():
                raise StartupError(f"metadata exited:\n{self.process.log_tail()}")
            return await ready()

        await eventually(up, timeout_s=60, interval_s=0.1, what="the metadata service up")

    def kill(self) -> None:
        assert self.process.proc is not None
        self.process.proc.kill()  # SIGKILL: no graceful shutdown
        self.process.proc.wait()


@pytest.fixture
async def metadata(etcd: LocalEtcd, prefix: str, tmp_path: Path) -> AsyncIterator[Metadata]:
    service = Metadata(etcd, prefix, tmp_path)
    await service.start()
    try:
        yield service
    finally:
        service.process.stop()


@pytest.fixture
async def purger(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    """The eviction leader: what purges the handles of a node whose registration lapsed."""
    process = await start_purging_leader(etcd, prefix)
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
def agents() -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    for agent in started:
        agent.stop(timeout_s=5.0)


def _start_agent(
    agents: list[NodeAgent], target: str, node_id: str, engine: Engine, **settings: float
) -> NodeAgent:
    node = make_node(node_id)
    agent = NodeAgent(
        NodeAgentSettings(
            metadata_target=target,
            lease_ttl_s=LEASE_TTL_S,
            load_interval_s=0.1,
            backoff_initial_s=0.02,
            backoff_max_s=0.3,
            rpc_timeout_s=1.0,
            credentials=MESH_CREDENTIALS,
            **settings,  # type: ignore[arg-type]
        ),
        node,
        lambda: NodeLoad(node.node_id, ""),
        engine.on_release,
    )
    agent.start()
    agents.append(agent)
    return agent


async def _true(value: bool) -> bool:
    return value


async def _lease_ttl_left(store: Store, lease: int) -> int:
    """Seconds etcd still gives `lease` (-1: gone)."""
    resp = await store.leases.etcd.call(
        "lease_ttl", lambda conn: conn.lease.LeaseTimeToLive, rpc.LeaseTimeToLiveRequest(ID=lease)
    )
    return int(resp.TTL)


async def test_a_node_keeps_its_registration_and_handles_across_a_metadata_restart(
    metadata: Metadata, purger: ServiceProcess, store: Store, agents: list[NodeAgent]
) -> None:
    engine = Engine()
    agent = _start_agent(agents, metadata.target, "d-keeps", engine)
    await eventually(lambda: _true(agent.stats().registered), what="registration")
    registered = make_node("d-keeps", incarnation=agent.incarnation)
    agent.publish(make_handle(registered, conversation="c1", request_id="r1"))
    await eventually(lambda: _true(agent.stats().published == 1), what="the publish")
    before = await store.get_node("d-keeps")
    handle = await store.get_handle_record("acme", "c1")
    assert before is not None and handle is not None

    metadata.kill()
    ttl_at_kill = await _lease_ttl_left(store, before.lease)
    await metadata.start()

    # A keep-alive through the restarted service: the lease's time left goes up again after
    # the restart (it only runs down while nobody refreshes it).
    lowest = ttl_at_kill

    async def refreshed() -> bool:
        nonlocal lowest
        left = await _lease_ttl_left(store, before.lease)
        if left > lowest:
            return True
        lowest = min(lowest, left)
        return False

    await eventually(refreshed, timeout_s=LEASE_TTL_S, interval_s=0.2, what="a keep-alive after the restart")
    after = await store.get_node("d-keeps")
    assert after is not None
    assert (after.node.incarnation, after.lease) == (before.node.incarnation, before.lease)
    assert agent.stats().registrations == 1, "the node never had to register again"
    kept = await store.get_handle_record("acme", "c1")
    assert kept is not None and kept.handle.handle_id == handle.handle.handle_id, "not purged"
    assert engine.freed == [], "no release, no reconcile"
    assert agent.stats().reconciled_freed == 0


async def test_a_publish_failing_past_its_deadline_is_given_up_and_its_blocks_freed(
    metadata: Metadata, agents: list[NodeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvplane.connector.node_agent")
    engine = Engine()
    agent = _start_agent(agents, metadata.target, "d-gives-up", engine, publish_give_up_s=1.0)
    await eventually(lambda: _true(agent.stats().registered), what="registration")
    registered = make_node("d-gives-up", incarnation=agent.incarnation)
    metadata.kill()  # and it stays down: every publish fails

    handle = make_handle(registered, conversation="c1", request_id="r-stuck").with_id("h-stuck")
    agent.publish(handle)
    await eventually(
        lambda: _true(agent.stats().publishes_given_up == 1), timeout_s=20, what="the publish given up"
    )
    assert engine.freed == ["r-stuck"], "nothing would ever reference its blocks: they are freed"
    assert agent.pending() == ([], []), "it no longer holds up the queue"
    assert any("h-stuck" in r.getMessage() and "c1" in r.getMessage() for r in caplog.records)


async def test_a_handle_that_expired_while_the_control_plane_was_away_is_never_published(
    metadata: Metadata, store: Store, agents: list[NodeAgent]
) -> None:
    engine = Engine()
    agent = _start_agent(agents, metadata.target, "d-expired", engine)
    await eventually(lambda: _true(agent.stats().registered), what="registration")
    registered = make_node("d-expired", incarnation=agent.incarnation)
    metadata.kill()
    agent.publish(make_handle(registered, conversation="c-old", request_id="r-old", life_ms=1500))
    await eventually(
        lambda: _true(agent.stats().publishes_given_up == 1),
        timeout_s=20,
        what="the expired publish given up",
    )
    assert engine.freed == ["r-old"]
    await metadata.start()
    agent.publish(make_handle(registered, conversation="c-new", request_id="r-new"))
    await eventually(lambda: _true(agent.stats().published == 1), timeout_s=30, what="the next publish")
    assert await store.get_handle_record("acme", "c-old") is None
