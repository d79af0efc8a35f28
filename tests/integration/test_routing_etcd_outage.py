"""Degradation: with etcd down, Route recomputes from its cached view; with etcd back, it pulls again."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from kvplane.services.common.local_etcd import LocalEtcd
from kvplane.services.common.nodes import NodeRole
from kvplane.services.common.store import Store, StoreSettings

from tests.support.routing_cluster import HISTORY_TOKENS, MODEL, RoutingCluster, decode_params, node, tokens


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
    own_etcd: LocalEtcd,
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
        replica = await cluster.add_replica()
        await cluster.wait_nodes()
        view = replica.ctx.view
        async with cluster.client("acme", timeout_s=10.0) as client:
            conversation = "outage"
            history = tokens(HISTORY_TOKENS)
            handle_id = await client.report_turn(
                None, conversation, success=True, decode_kv_transfer_params=decode_params(d0, history)
            )
            await cluster.wait_handle("acme", conversation, handle_id)

            own_etcd.stop()
            assert await view.wait_for(lambda: not view.healthy, 10.0), (
                "the view never noticed etcd going away"
            )
            started = time.monotonic()
            during = await client.route(conversation, MODEL, prompt_token_ids=[*history, 1])
            assert during.decision == "recompute_contended", during.reason
            assert during.prefill_params["remote_engine_id"] is None
            assert (during.prefill.node_id, during.decode.node_id) == ("p0", "d0")
            assert time.monotonic() - started < 1.0, "Route waited on etcd"
            # A first turn is answered too, from the cached nodes.
            fresh = await client.route("another", MODEL, prompt_tokens=100)
            assert fresh.decision == "recompute_no_handle"

            own_etcd.start()
            assert await view.wait_for(lambda: view.healthy, 15.0), "the view did not recover"
            # The handle was never checked out, so it is still there to pull.
            after = await client.route(conversation, MODEL, prompt_token_ids=[*history, 1])
            assert after.decision == "pull", after.reason
            assert after.response.handle.handle_id == handle_id
            # And a new turn's handle is published and pulled as usual.
            longer = [*history, 1, *tokens(64, seed=3)]
            new_id = await client.report_turn(
                after, conversation, success=True, decode_kv_transfer_params=decode_params(d0, longer)
            )
            await cluster.wait_handle("acme", conversation, new_id)
            third = await client.route(conversation, MODEL, prompt_token_ids=[*longer, 2])
            assert third.decision == "pull", third.reason
    finally:
        await cluster.stop()
        await store.close()
