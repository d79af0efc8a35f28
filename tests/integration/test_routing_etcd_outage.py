"""Degradation: with etcd down, Route recomputes from its cached view; with etcd back, it pulls again."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path

import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.routing.policy.config import DEFAULT_POLICY_FILE
from tests.support.polling import eventually
from tests.support.routing_cluster import HISTORY_TOKENS, MODEL, RoutingCluster, decode_params, node, tokens

DEFAULT_POLICY = (
    resources.files("kvplane.services.routing.policy")
    .joinpath(DEFAULT_POLICY_FILE)
    .read_text(encoding="utf-8")
)


def _async_true_after(unix_ms: int) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return time.time() * 1000 > unix_ms

    return probe


@pytest.fixture
async def own_etcd() -> AsyncIterator[LocalEtcd]:
    """An etcd of this test's own, since the test stops it."""
    server = LocalEtcd()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


async def test_etcd_outage_turns_pulls_into_recomputes_and_restart_restores_pulls(
    own_etcd: LocalEtcd, tmp_path: Path
) -> None:
    prefix = f"/kvplane-test/{uuid.uuid4().hex}/"
    store = Store(
        StoreSettings(
            endpoints=(own_etcd.endpoint,), prefix=prefix, request_timeout_s=1.0, settle_timeout_s=2.0
        )
    )
    await store.connect()
    cluster = RoutingCluster(own_etcd, prefix, store)
    try:
        await cluster.register(node("p0", NodeRole.PREFILL))
        d0 = await cluster.register(node("d0", NodeRole.DECODE))
        # Load reports count as stale after 300 ms, so the outage outlives them.
        policy = tmp_path / "policy.yaml"
        policy.write_text(
            DEFAULT_POLICY.replace("    - live\n", "    - {name: live, params: {max_load_age_ms: 300}}\n")
        )
        replica = await cluster.add_replica(policy_file=str(policy))
        await cluster.wait_nodes()
        view = replica.ctx.view
        # The caller would wait 60 s: a Route that ends well before that was bounded by the
        # check-out's own deadline (a few seconds), however loaded the machine.
        async with cluster.client("acme", timeout_s=60.0) as client:
            conversation = "outage"
            history = tokens(HISTORY_TOKENS)
            handle_id = await cluster.report("acme", conversation, decode_params(d0, history))
            await cluster.wait_handle("acme", conversation, handle_id)

            await cluster.report_load("p0", queued_prefill_tokens=10)
            await cluster.report_load("d0", running_requests=1)
            await cluster.wait_views(lambda v: {"p0", "d0"} <= set(v.loads), "loads in the view")
            reported_ms = max(load.reported_unix_ms for load in view.loads.values())
            own_etcd.stop()
            assert await view.wait_for(lambda: not view.healthy, 10.0), (
                "the view never noticed etcd going away"
            )
            await eventually(
                _async_true_after(reported_ms + 600),
                what="the last load report to be older than the policy's limit",
            )
            started = time.monotonic()
            # By length alone: a prefix cache hint the next turn's token ids cannot be proven against,
            # so that turn still finds the handle worth pulling.
            during = await client.route(conversation, MODEL, prompt_tokens=HISTORY_TOKENS + 1)
            assert during.decision == "recompute_contended", during.reason
            assert during.prefill_params["remote_engine_id"] is None
            assert (during.prefill.node_id, during.decode.node_id) == ("p0", "d0")
            assert time.monotonic() - started < 1.0, "Route waited on etcd"
            # A first turn is answered too, from the cached nodes.
            fresh = await client.route("another", MODEL, prompt_tokens=100)
            assert fresh.decision == "recompute_no_handle"

            own_etcd.start()
            assert await view.wait_for(lambda: view.healthy, 15.0), "the view did not recover"
            # Live again: nodes report again, as their agents do every few hundred ms.
            await cluster.report_load("p0", queued_prefill_tokens=10)
            await cluster.report_load("d0", running_requests=1)
            fresh_ms = int(time.time() * 1000)
            await cluster.wait_views(
                lambda v: all(load.reported_unix_ms >= fresh_ms - 50 for load in v.loads.values()),
                "fresh loads",
            )
            # The handle was never checked out, so it is still there to pull.
            after = await client.route(conversation, MODEL, prompt_token_ids=[*history, 1])
            assert after.decision == "pull", after.reason
            assert after.response.handle.handle_id == handle_id
            # And a new turn's handle is published and pulled as usual.
            # A long answer (P holds only the previous prompt): most of it is worth pulling.
            longer = [*history, 1, *tokens(3000, seed=3)]
            new_id = await cluster.report("acme", conversation, decode_params(d0, longer), route=after)
            await cluster.wait_handle("acme", conversation, new_id)
            await cluster.report_load("p0", queued_prefill_tokens=10)
            await cluster.report_load("d0", running_requests=1)
            third = await client.route(conversation, MODEL, prompt_token_ids=[*longer, 2])
            assert third.decision == "pull", third.reason
    finally:
        await cluster.stop()
        await store.close()


async def test_a_frozen_etcd_costs_one_check_out_timeout_then_recomputes(own_etcd: LocalEtcd) -> None:
    # A frozen etcd keeps its connections open: the view still looks healthy,
    # so only the check-out's own deadline stands between the turn and a hang.
    prefix = f"/kvplane-test/{uuid.uuid4().hex}/"
    store = Store(StoreSettings(endpoints=(own_etcd.endpoint,), prefix=prefix))
    await store.connect()
    cluster = RoutingCluster(own_etcd, prefix, store)
    assert own_etcd.proc is not None
    frozen = False
    try:
        await cluster.register(node("p0", NodeRole.PREFILL))
        d0 = await cluster.register(node("d0", NodeRole.DECODE))
        await cluster.add_replica()
        await cluster.wait_nodes()
        history = tokens(HISTORY_TOKENS)
        handle_id = await cluster.report("acme", "frozen", decode_params(d0, history))
        await cluster.wait_handle("acme", "frozen", handle_id)
        # The caller would wait 60 s: a Route that ends well before that was bounded by the
        # check-out's own deadline (a few seconds), however loaded the machine.
        async with cluster.client("acme", timeout_s=60.0) as client:
            os.kill(own_etcd.proc.pid, signal.SIGSTOP)
            frozen = True
            started = time.monotonic()
            result = await client.route("frozen", MODEL, prompt_token_ids=[*history, 1])
            elapsed = time.monotonic() - started
            assert result.decision == "recompute_contended", result.reason
            assert elapsed < 30.0, f"Route took {elapsed:.1f} s"
    finally:
        if frozen:
            os.kill(own_etcd.proc.pid, signal.SIGCONT)
        await cluster.stop()
        await store.close()
