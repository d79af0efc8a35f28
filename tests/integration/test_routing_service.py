"""The routing service against a real etcd and real gRPC servers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvplane.connector.prefix_check import PullOutcome, check_pull
from kvplane.services.client import RoutingClient, decode_body, prefill_body
from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import HandleNotRetained, NotFound
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_HANDLE_ID,
    KEY_TENANT,
    fresh_prefill_params,
)
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.routing.adapters import StoreCheckOut, SystemClock, ViewCluster
from kvplane.services.routing.endpoints import side_channel_url
from kvplane.services.routing.metrics import RoutingMetrics
from kvplane.services.routing.policy import Prompt
from kvplane.services.routing.service import RoutingService
from tests.support.routing_cluster import (
    HISTORY_TOKENS,
    MODEL,
    RoutingCluster,
    decode_params,
    handle_for,
    node,
    prefill_and_decode,
    tokens,
)


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix, replicas=1) as c:
        yield c


@pytest.fixture
async def client(cluster: RoutingCluster) -> AsyncIterator[RoutingClient]:
    async with cluster.client("acme") as c:
        yield c


def conv() -> str:
    return f"conv-{uuid.uuid4().hex[:8]}"


async def test_first_turn_gets_fresh_params_with_the_exact_vllm_keys(client: RoutingClient) -> None:
    result = await client.route(conv(), MODEL, prompt_token_ids=tokens(300))
    assert result.decision == "recompute_no_handle"
    expected = fresh_prefill_params()
    vllm_part = {k: v for k, v in result.prefill_params.items() if not k.startswith("kvplane_")}
    assert vllm_part == expected
    assert result.prefill_params[KEY_TENANT] == "acme"
    assert result.prefill.node_id == "p0" and result.decode.node_id == "d0"
    assert result.expected_reused_tokens == 0
    assert result.route_id


async def test_second_turn_pulls_with_every_handle_key_passed_through(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    # A long answer (a tool's output, say): P's prefix cache holds only the first prompt,
    # so most of the history is worth pulling.
    first = await client.route(c, MODEL, prompt_token_ids=history[:1000])
    d_params = decode_params(cluster.nodes["d0"], history)
    handle_id = await cluster.report("acme", c, d_params, route=first, ttft_ms=200, prompt_tokens=1000)
    assert handle_id == d_params[KEY_HANDLE_ID]
    await cluster.wait_handle("acme", c, handle_id)
    read = await cluster.store.get_handle_record("acme", c)
    assert read is not None

    second = await client.route(c, MODEL, prompt_token_ids=[*history, 7, 8, 9])
    assert second.decision == "pull", second.reason
    assert second.expected_reused_tokens == HISTORY_TOKENS
    sent = second.prefill_params
    for key, value in d_params.items():
        if key in ("do_remote_decode", "do_remote_prefill", KEY_HANDLE_ID):
            continue
        assert sent[key] == value, key
    assert sent["do_remote_decode"] is True and sent["do_remote_prefill"] is False
    assert sent["remote_blocks_expiry_time"] == 98765.4321
    assert sent[KEY_DIGESTS] == d_params[KEY_DIGESTS]
    assert sent[KEY_TENANT] == "acme" and sent[KEY_CONVERSATION] == c
    assert second.response.handle.handle_id == handle_id
    assert convert.handle_from_pb(second.response.handle) == read.handle, "the handle as it was read"
    # Checked out: gone from etcd, so no other turn can read the blocks.
    assert await cluster.store.get_handle_record("acme", c) is None

    # The gateway's two bodies: P gets exactly these params; D gets P's plus our keys.
    p_body = prefill_body({"model": MODEL, "prompt": [1, 2], "stream": True, "max_tokens": 99}, second)
    assert p_body["stream"] is False and p_body["max_tokens"] == 1
    assert p_body["kv_transfer_params"] == second.prefill_params
    p_returned = {"do_remote_prefill": True, "remote_engine_id": "engine-p0", "remote_block_ids": [[1]]}
    d_body = decode_body({"model": MODEL, "stream": True}, second, {"kv_transfer_params": p_returned})
    assert d_body["stream"] is True
    assert d_body["kv_transfer_params"] == {**p_returned, KEY_TENANT: "acme", KEY_CONVERSATION: c}


@pytest.mark.parametrize("retained", [HISTORY_TOKENS, HISTORY_TOKENS + 7])
async def test_pull_params_pass_the_prefill_connectors_prefix_check(
    cluster: RoutingCluster, client: RoutingClient, retained: int
) -> None:
    # The contract with the P connector: the digests the router forwards prove
    # the prompt, and only whole verified blocks are pulled.
    c = conv()
    history = tokens(retained)
    await cluster.wait_handle(
        "acme", c, await cluster.report("acme", c, decode_params(cluster.nodes["d0"], history))
    )
    prompt = [*history, 1, 2, 3]
    result = await client.route(c, MODEL, prompt_token_ids=prompt)
    assert result.decision == "pull", result.reason
    params = dict(result.prefill_params)
    check = check_pull(params, prompt)
    whole = retained // 16 * 16
    expected = PullOutcome.VERIFIED if whole == retained else PullOutcome.CLIPPED
    assert check.outcome is expected
    assert params["remote_num_tokens"] == whole == result.expected_reused_tokens
    assert check_pull(dict(result.prefill_params), [*history[:-40], 9, 9, 9]).outcome is PullOutcome.CLIPPED


async def test_two_concurrent_routes_pull_exactly_once(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    prompt = [*history, 1, 2, 3]
    results = await asyncio.gather(*(client.route(c, MODEL, prompt_token_ids=prompt) for _ in range(2)))
    decisions = [r.decision for r in results]
    assert decisions.count("pull") == 1, decisions
    loser = next(r for r in results if r.decision != "pull")
    # It lost the check-out race, or its view already saw the handle go.
    assert loser.decision in ("recompute_contended", "recompute_no_handle")
    assert "remote_block_ids" in loser.prefill_params and loser.prefill_params["remote_block_ids"] is None


async def test_the_loser_of_a_check_out_race_recomputes_contended(cluster: RoutingCluster) -> None:
    # Both turns read the same view entry before either check-out lands, so the
    # second one's fenced transaction must fail.
    process = cluster.replicas[0]
    service = RoutingService(process.store, process.ctx.view, process.settings.routing, Telemetry.disabled())
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    prompt = Prompt(HISTORY_TOKENS + 1, [*history, 1])
    outcomes = await asyncio.gather(*(service.route("acme", c, MODEL, prompt) for _ in range(3)))
    assert sorted(o.decision.value for o in outcomes) == [
        "pull",
        "recompute_contended",
        "recompute_contended",
    ]
    winner = next(o for o in outcomes if o.handle is not None)
    assert winner.handle is not None and winner.handle.handle_id == handle.handle_id
    assert all(o.prefill_params["remote_block_ids"] is None for o in outcomes if o.handle is None)


async def test_a_deadline_too_short_for_the_check_out_recomputes_and_keeps_the_handle(
    cluster: RoutingCluster,
) -> None:
    process = cluster.replicas[0]
    service = RoutingService(process.store, process.ctx.view, process.settings.routing, Telemetry.disabled())
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    prompt = Prompt(HISTORY_TOKENS + 1, [*history, 1])
    rushed = await service.route("acme", c, MODEL, prompt, time_budget_s=0.001)
    assert rushed.decision.value == "recompute_contended" and "deadline" in rushed.reason
    assert await cluster.store.get_handle_record("acme", c) is not None
    # Another replica: this one sent the prompt to P already, whose prefix cache now holds it.
    other = RoutingService(process.store, process.ctx.view, process.settings.routing, Telemetry.disabled())
    relaxed = await other.route("acme", c, MODEL, prompt, time_budget_s=5.0)
    assert relaxed.decision.value == "pull"


async def test_the_routers_live_ports_read_the_view_and_check_a_handle_out_once(
    cluster: RoutingCluster,
) -> None:
    process = cluster.replicas[0]
    view = process.ctx.view
    ports = ViewCluster(view, RoutingMetrics.create(CollectorRegistry()))
    c = conv()
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, tokens(HISTORY_TOKENS)))
    await cluster.wait_handle("acme", c, handle.handle_id)
    assert ports.healthy
    assert {s.node.node_id for s in ports.node_states()} == set(view.nodes)
    assert ports.node("d0") == view.nodes["d0"].node and ports.node("no-such-node") is None
    assert ports.newest_report_unix_ms() >= 0
    assert await ports.wait_published("acme", c, handle.handle_id, 0.0)
    assert not await ports.await_handle("acme", c, "another-handle", 0.05)
    record = ports.handle("acme", c)
    assert record is not None
    checkout = StoreCheckOut(process.store)
    checked = await checkout.check_out("acme", c, "route-1", record, 5.0)
    assert checked.handle.handle_id == handle.handle_id
    with pytest.raises((HandleNotRetained, NotFound)):
        await checkout.check_out("acme", c, "route-2", record, 5.0)
    assert abs(SystemClock().unix_ms() - time.time() * 1000) < 60_000


async def test_a_route_awaiting_a_handle_that_came_and_went_does_not_wait_for_it(
    cluster: RoutingCluster,
) -> None:
    process = cluster.replicas[0]
    registry = CollectorRegistry()
    ports = ViewCluster(process.ctx.view, RoutingMetrics.create(registry))

    def waits(outcome: str) -> float | None:
        return registry.get_sample_value("kvplane_route_publish_wait_seconds_count", {"outcome": outcome})

    c = conv()
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, tokens(HISTORY_TOKENS)))
    await cluster.wait_handle("acme", c, handle.handle_id)
    record = ports.handle("acme", c)
    assert record is not None
    # Another turn takes it: the view sees it go.
    await StoreCheckOut(process.store).check_out("acme", c, "route-1", record, 5.0)
    assert await process.ctx.view.wait_for(lambda: ports.handle("acme", c) is None, 15)
    # Awaited for far longer than the test may take: it answers at once, as ended.
    async with asyncio.timeout(30):
        assert not await ports.await_handle("acme", c, handle.handle_id, 600.0)
    assert waits("ended") == 1
    # A handle the view never saw still gets its wait.
    assert not await ports.await_handle("acme", c, "not-yet-published", 0.05)
    assert waits("timeout") == 1


async def test_concurrent_routes_through_two_replicas_pull_exactly_once(cluster: RoutingCluster) -> None:
    await cluster.add_replica()
    await cluster.wait_nodes()
    history = tokens(HISTORY_TOKENS)
    async with cluster.client("acme", 0) as first, cluster.client("acme", 1) as second:
        for _ in range(5):
            c = conv()
            handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
            await cluster.wait_handle("acme", c, handle.handle_id)
            prompt = [*history, 1]
            results = await asyncio.gather(
                first.route(c, MODEL, prompt_token_ids=prompt),
                second.route(c, MODEL, prompt_token_ids=prompt),
            )
            assert [r.decision for r in results].count("pull") == 1
            # The loser either lost the check-out race, or its view already saw the handle go.
            assert {r.decision for r in results} - {"pull"} <= {"recompute_contended", "recompute_no_handle"}


async def test_handle_inside_the_expiry_margin_recomputes_expiring(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history, life_ms=3_000))
    await cluster.wait_handle("acme", c, handle.handle_id)
    result = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert result.decision == "recompute_expiring", result.reason
    assert result.prefill_params["remote_engine_id"] is None


async def test_holder_whose_lease_is_gone_recomputes_holder_down(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    holder = await cluster.register(node("d1", NodeRole.DECODE))
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(holder, "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    await cluster.kill_node("d1")
    await cluster.wait_views(lambda v: "d1" not in v.nodes, "d1 gone from the view")
    result = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert result.decision == "recompute_holder_down", result.reason
    assert result.decode.node_id == "d0"


async def test_few_reusable_tokens_recompute_below_threshold(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(40)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    result = await client.route(c, MODEL, prompt_token_ids=[*history, *tokens(500, seed=9)])
    assert result.decision == "recompute_below_threshold", result.reason


async def test_a_transfer_slower_than_recomputing_recomputes_cost(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # 4 MiB of KV per token: pulling 4k tokens would take far longer than computing them.
    heavy = await cluster.register(node("d-heavy", NodeRole.DECODE, kv_bytes_per_token=4 << 20))
    await cluster.wait_nodes()
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(heavy, "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    result = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert result.decision == "recompute_cost", result.reason
    assert await cluster.store.get_handle_record("acme", c) is not None


@pytest.mark.parametrize(
    ("case", "decision"),
    [
        # Too short a verified prefix (about 300 tokens) to pay for a transfer, even between
        # engines that have met (a first pull's handshake lengthens it, but declines nothing).
        ("edited_message", "recompute_prefix_mismatch"),
        ("foreign_digests", "recompute_prefix_mismatch"),
        # Most of the history is verified: it is pulled, clipped, and the rest recomputed.
        ("stripped_reasoning_trace", "pull_prefix"),
        ("retried_turn", "pull_prefix"),
    ],
)
async def test_prompt_that_does_not_continue_the_handle_pulls_only_a_verified_prefix_that_pays(
    cluster: RoutingCluster, client: RoutingClient, case: str, decision: str
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    new_message = tokens(200, seed=5)
    if case == "edited_message":
        prompt = [*history[:300], 424242, *history[301:], *new_message]
    elif case == "stripped_reasoning_trace":
        # The previous answer's <think> span (its last 600 tokens but 100) is dropped.
        prompt = [*history[: HISTORY_TOKENS - 700], *history[HISTORY_TOKENS - 100 :], *new_message]
    elif case == "retried_turn":
        # The same turn again: the previous prompt, without the answer D retains.
        prompt = history[: HISTORY_TOKENS - 300]
    else:
        prompt = [*tokens(HISTORY_TOKENS, seed=2), *new_message]
    result = await client.route(c, MODEL, prompt_token_ids=prompt)
    assert result.decision == decision, result.reason
    if decision == "recompute_prefix_mismatch":
        # The handle stays retained: nothing was checked out.
        assert await cluster.store.get_handle_record("acme", c) is not None
        return
    verified = result.expected_reused_tokens
    assert 0 < verified < len(prompt)
    # P's vLLM reads remote_num_tokens from the tail of remote_block_ids: both cut to the prefix.
    params = dict(result.prefill_params)
    assert params["remote_num_tokens"] == verified
    assert len(params["remote_block_ids"][0]) == -(-verified // 16)
    assert check_pull(params, prompt).outcome is PullOutcome.VERIFIED
    assert await cluster.store.get_handle_record("acme", c) is None


async def test_an_edited_message_late_in_the_history_pulls_the_prefix_before_it(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    edited = [*history[:3000], 424242, *history[3001:], *tokens(200, seed=5)]
    result = await client.route(c, MODEL, prompt_token_ids=edited)
    assert result.decision == "pull_prefix", result.reason
    assert 2048 <= result.expected_reused_tokens <= 3000 and result.expected_reused_tokens % 16 == 0
    params = dict(result.prefill_params)
    assert params["remote_num_tokens"] == result.expected_reused_tokens
    # The handle's first blocks, in its order (they hold the prefix's positions).
    assert params["remote_block_ids"] == [
        list(handle.vllm.remote_block_ids[0][: result.expected_reused_tokens // 16])
    ]
    # The prefill connector proves the same prefix and leaves the clipped pull as it is.
    check = check_pull(params, edited)
    assert check.outcome is PullOutcome.VERIFIED and check.verified_tokens == result.expected_reused_tokens


async def test_handle_without_digests_recomputes_rather_than_pulling_unproven(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    params = decode_params(cluster.nodes["d0"], history, with_digests=False)
    handle_id = await cluster.report("acme", c, params)
    await cluster.wait_handle("acme", c, handle_id)
    result = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert result.decision == "recompute_prefix_mismatch"


async def test_report_turn_digests_retained_token_ids_when_the_engine_sent_none(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    # A D without kvplane's connector: the report is the handle's only source.
    params = decode_params(cluster.nodes["d0"], history, kvplane_connector=False)
    handle_id = await cluster.report("acme", c, params, retained_token_ids=history)
    await cluster.wait_handle("acme", c, handle_id)
    edited = [*history[:10], 0, *history[11:], 5]
    assert (await client.route(c, MODEL, prompt_token_ids=edited)).decision == "recompute_prefix_mismatch"
    assert (await client.route(c, MODEL, prompt_token_ids=[*history, 5])).decision == "pull"


async def test_tenants_sharing_a_conversation_id_never_see_each_others_handle(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    params = decode_params(cluster.nodes["d0"], history)
    await cluster.report("acme", c, params)
    await cluster.wait_handle("acme", c)
    async with cluster.client("globex") as other:
        stolen = await other.route(c, MODEL, prompt_token_ids=[*history, 1])
        assert stolen.decision == "recompute_no_handle"
        assert stolen.prefill_params["remote_engine_id"] is None
        assert stolen.prefill_params[KEY_TENANT] == "globex"
        # A body field cannot name another tenant for a tenant caller.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.route(c, MODEL, prompt_token_ids=[*history, 1], tenant="acme")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Nor can a report smuggle a handle in under the other tenant's keys.
        forged = decode_params(cluster.nodes["d0"], history, **{KEY_TENANT: "acme"})
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.report_turn(None, c, success=True, decode_kv_transfer_params=forged)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert not await other.end_conversation(c)
    owner = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert owner.decision == "pull"


async def test_a_tenant_caller_cannot_publish_a_handle_only_report_one(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # A tenant could otherwise name blocks it does not own on any engine.
    c = conv()
    history = tokens(HISTORY_TOKENS)
    forged = decode_params(cluster.nodes["d0"], history)
    assert await client.report_turn(None, c, success=True, decode_kv_transfer_params=forged) == ""
    assert await cluster.store.get_handle_record("acme", c) is None
    # What the engine's connector published is acknowledged by id.
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    echoed = decode_params(cluster.nodes["d0"], history, **{KEY_HANDLE_ID: handle.handle_id})
    assert (
        await client.report_turn(None, c, success=True, decode_kv_transfer_params=echoed) == handle.handle_id
    )


async def test_nodes_with_another_fingerprint_are_never_chosen(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # An idle fp8 pool beside a busy bf16 pool that holds the handle.
    await cluster.register(node("p-fp8", NodeRole.PREFILL, kv_dtype="fp8_e4m3"))
    await cluster.register(node("d-fp8", NodeRole.DECODE, kv_dtype="fp8_e4m3"))
    await cluster.report_load("p0", queued_prefill_tokens=200_000, running_requests=50)
    await cluster.report_load("d0", running_requests=200, free_kv_blocks=10_000, total_kv_blocks=100_000)
    await cluster.report_load("p-fp8", free_kv_blocks=100_000, total_kv_blocks=100_000)
    await cluster.report_load("d-fp8", free_kv_blocks=100_000, total_kv_blocks=100_000)
    await cluster.wait_nodes()
    await cluster.wait_views(lambda v: {"p0", "d0", "p-fp8", "d-fp8"} <= set(v.loads), "loads in views")
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    result = await client.route(c, MODEL, prompt_token_ids=[*history, 1])
    assert result.decision == "pull", result.reason
    assert (result.prefill.node_id, result.decode.node_id) == ("p0", "d0")
    # Without a handle, P and D still always share a fingerprint.
    for _ in range(20):
        r = await client.route(conv(), MODEL, prompt_tokens=100)
        assert (r.prefill.node_id, r.decode.node_id) in {("p0", "d0"), ("p-fp8", "d-fp8")}


async def test_a_handle_published_through_one_replica_is_pulled_through_another(
    cluster: RoutingCluster,
) -> None:
    await cluster.add_replica()
    await cluster.wait_nodes()
    c = conv()
    history = tokens(HISTORY_TOKENS)
    async with cluster.client("acme", 0) as first, cluster.client("acme", 1) as second:
        handle_id = await cluster.report("acme", c, decode_params(cluster.nodes["d0"], history), 0)
        await cluster.wait_handle("acme", c, handle_id)
        result = await second.route(c, MODEL, prompt_token_ids=[*history, 1])
        assert result.decision == "pull", result.reason
        assert result.response.handle.handle_id == handle_id
        again = await first.route(c, MODEL, prompt_token_ids=[*history, 1])
        assert again.decision != "pull"


async def test_end_conversation_releases_the_retained_handle(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    handle = await cluster.publish(handle_for(cluster.nodes["d0"], "acme", c, history))
    await cluster.wait_handle("acme", c, handle.handle_id)
    assert await client.end_conversation(c)
    assert await cluster.store.get_handle_record("acme", c) is None
    pending = await cluster.store.pending_releases("d0")
    assert [p.handle.handle_id for p, _ in pending] == [handle.handle_id]
    assert not await client.end_conversation(c)


async def test_unknown_model_is_not_found_not_internal(client: RoutingClient) -> None:
    # The request's own error (the gateway answers it 404), not an outage of routing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.route(conv(), "no-such-model", prompt_tokens=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in (err.value.details() or "")


async def test_invalid_requests_are_invalid_argument(cluster: RoutingCluster, client: RoutingClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.route(conv(), MODEL, prompt_tokens=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.route(conv(), MODEL, prompt_tokens=5, prompt_token_ids=[1, 2, 3])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster.report("acme", conv(), {"remote_engine_id": "x"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        plain = decode_params(cluster.nodes["d0"], tokens(64), kvplane_connector=False)
        await cluster.report("acme", conv(), plain, model="other")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_ipv6_nodes_get_bracketed_urls_and_side_channel(etcd: LocalEtcd, prefix: str) -> None:
    store = Store(StoreSettings(endpoints=(etcd.endpoint,), prefix=prefix))
    await store.connect()
    c = RoutingCluster(etcd, prefix, store)
    try:
        await c.register(node("p6", NodeRole.PREFILL, host="::1"))
        d6 = await c.register(node("d6", NodeRole.DECODE, host="fd00::7"))
        await c.add_replica(listen_host="::1")
        await c.wait_nodes()
        assert c.target().startswith("[::1]:")
        async with c.client("acme") as client:
            cv = conv()
            history = tokens(HISTORY_TOKENS)
            # A long answer: P's prefix cache holds only the first prompt.
            first = await client.route(cv, MODEL, prompt_token_ids=history[:1000])
            for endpoint, host in ((first.prefill, "::1"), (first.decode, "fd00::7")):
                parts = urlsplit(endpoint.http_url)
                assert parts.hostname == host and parts.port is not None
                assert f"[{host}]" in endpoint.http_url
            handle_id = await c.report("acme", cv, decode_params(d6, history), route=first)
            await c.wait_handle("acme", cv, handle_id)
            second = await client.route(cv, MODEL, prompt_token_ids=[*history, 1])
            assert second.decision == "pull", second.reason
            params = second.prefill_params
            assert params["remote_host"] == "fd00::7"
            assert side_channel_url(params["remote_host"], params["remote_port"]) == "tcp://[fd00::7]:5600"
            json.dumps(params)
    finally:
        await c.stop()
        await store.close()


async def test_a_burst_of_turns_between_two_load_reports_spreads_over_prefill_nodes(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    for name in ("p1", "p2", "p3"):
        await cluster.register(node(name, NodeRole.PREFILL))
    await cluster.wait_nodes()
    # By the reports alone p0 is the idle one; the others each have a short queue.
    await cluster.report_load("p0", queued_prefill_tokens=0)
    for name in ("p1", "p2", "p3"):
        await cluster.report_load(name, queued_prefill_tokens=1000)
    await cluster.wait_views(lambda v: {"p0", "p1", "p2", "p3"} <= set(v.loads), "loads in views")
    picked = [
        (await client.route(conv(), MODEL, prompt_token_ids=tokens(4000, seed=i))).prefill.node_id
        for i in range(8)
    ]
    # Each route counts the work it sent until a report shows it: the burst spreads.
    assert set(picked) == {"p0", "p1", "p2", "p3"}, picked
    assert max(picked.count(p) for p in set(picked)) <= 3, picked


async def test_a_restarted_engine_is_answered_with_its_new_address_and_incarnation(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    before = await client.route(conv(), MODEL, prompt_tokens=100)
    old = cluster.nodes["p0"]
    assert (before.prefill.http_url, before.prefill.incarnation) == (old.http_url, old.incarnation)

    restarted = await cluster.register(node("p0", NodeRole.PREFILL, host="127.0.0.2"))
    await cluster.wait_nodes()

    after = await client.route(conv(), MODEL, prompt_tokens=100)
    assert after.prefill.node_id == "p0"
    assert (after.prefill.http_url, after.prefill.incarnation) == (restarted.http_url, restarted.incarnation)
    assert after.prefill.http_url != before.prefill.http_url
