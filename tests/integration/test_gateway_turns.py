"""The gateway over the real stack: etcd, metadata and routing over gRPC, sim-engines with real NIXL.

One stack serves the whole module; each test uses its own conversations.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.gateway_stack import DECODE_STEP_S, MODEL, GatewayStack, TurnResult, gateway_stack
from tests.support.polling import eventually


@pytest.fixture(scope="module")
async def stack(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(etcd, f"/kvplane-gw/{uuid.uuid4().hex}/", tmp_path_factory.mktemp("gw")) as s:
        yield s


def new_ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30_000) for _ in range(n)]


def conversation() -> str:
    return f"conv-{uuid.uuid4().hex[:12]}"


async def complete(
    stack: GatewayStack,
    tenant: str,
    conv: str,
    prompt: list[int],
    *,
    stream: bool = False,
    # D generates enough that P's own prefix cache misses more than vLLM's recompute threshold.
    max_tokens: int = 80,
    **extra: Any,
) -> TurnResult:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if stream:
        body["stream"] = True
    result = await stack.post("/v1/completions", body, stack.headers(tenant, conv))
    assert result.status == 200, result.raw
    return result


async def pulled(stack: GatewayStack) -> float:
    return await stack.prefill.metric(
        stack.session, "kvplane_sim_kv_loads_total", leg="prefill", outcome="pulled"
    )


async def verify_failures(stack: GatewayStack) -> float:
    total = 0.0
    for engine in (stack.prefill, stack.decode):
        total += await engine.metric(stack.session, "kvplane_sim_kv_verify_failures_total")
    return total


async def retained_ids(stack: GatewayStack) -> set[str]:
    state = json.loads(await stack.decode.get(stack.session, "/sim/state"))
    return {r["request_id"] for r in state["retained"]}


def last_prefill_params(stack: GatewayStack) -> dict[str, Any]:
    params: dict[str, Any] = stack.proxy.seen[-1].body["kv_transfer_params"]
    return params


# -- turns that pull ---------------------------------------------------------------------


async def test_completion_turns_after_the_first_pull_their_history(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(400, 1)
    pulled_before = await pulled(stack)
    handle = ""
    decisions = []
    for turn in range(3):
        result = await complete(stack, "acme", conv, prompt, return_token_ids=True)
        decisions.append(result.decision)
        usage = result.body["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 80
        assert "kv_transfer_params" not in result.body
        if turn:
            params = last_prefill_params(stack)
            assert params["remote_engine_id"] and params["kvplane_tenant"] == "acme"
        handle = await stack.wait_handle("acme", conv, other_than=handle)
        prompt = prompt + result.output_ids() + new_ids(40, turn + 10)
    assert decisions == ["recompute_no_handle", "pull", "pull"]
    assert await pulled(stack) == pulled_before + 2
    assert await verify_failures(stack) == 0
    assert await stack.gateway_metric("kvplane_gateway_turns_total", decision="pull", outcome="ok") >= 2


async def test_streaming_chat_pulls_and_streams_token_by_token(stack: GatewayStack) -> None:
    conv = conversation()
    messages: list[dict[str, str]] = [{"role": "user", "content": "tell me about caches " * 20}]
    pulled_before = await pulled(stack)
    handle = ""
    decisions = []
    for turn in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": 80, "ignore_eos": True, "stream": True}
        result = await stack.post("/v1/chat/completions", body, stack.headers("acme", conv))
        assert result.status == 200, result.raw
        decisions.append(result.decision)
        content = [t for t, e in result.events if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(content) == 80
        # Each token leaves D a decode step after the last: the client sees them spread out, not at once.
        spread = content[-1] - content[0]
        assert spread >= 79 * DECODE_STEP_S * 0.5, spread
        assert "kv_transfer_params" not in result.raw and "token_ids" not in result.raw
        assert result.events[-1][1]["choices"][0]["finish_reason"] == "length"
        handle = await stack.wait_handle("acme", conv, other_than=handle)
        messages = [
            *messages,
            {"role": "assistant", "content": result.text()},
            {"role": "user", "content": f"and then, part {turn}?"},
        ]
    assert decisions == ["recompute_no_handle", "pull", "pull"]
    assert await pulled(stack) == pulled_before + 2
    assert await verify_failures(stack) == 0


async def test_streaming_completions_pull_and_report_usage(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(300, 2)
    first = await complete(stack, "acme", conv, prompt, stream=True, stream_options={"include_usage": True})
    await stack.wait_handle("acme", conv)
    prompt = prompt + [ord(c) + 3 for c in first.text()] + new_ids(30, 3)
    second = await complete(stack, "acme", conv, prompt, stream=True, stream_options={"include_usage": True})
    assert (first.decision, second.decision) == ("recompute_no_handle", "pull")
    usage = second.events[-1][1]["usage"]
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 80


async def test_a_turn_sent_right_after_the_last_one_still_pulls(stack: GatewayStack) -> None:
    """An agent's next turn can arrive before the last turn's report: the gateway lets it land first."""
    conv = conversation()
    prompt = new_ids(300, 19)
    decisions = []
    for turn in range(4):
        result = await complete(stack, "acme", conv, prompt, stream=turn % 2 == 1, return_token_ids=True)
        decisions.append(result.decision)
        prompt = prompt + result.output_ids() + new_ids(30, 20 + turn)
    assert decisions == ["recompute_no_handle", "pull", "pull", "pull"]


async def test_concurrent_conversations_each_pull_their_own_history(stack: GatewayStack) -> None:
    pulled_before = await pulled(stack)

    async def converse(index: int) -> list[str]:
        conv, prompt, handle, decisions = conversation(), new_ids(200, 100 + index), "", []
        for turn in range(3):
            result = await complete(stack, "acme", conv, prompt, stream=index % 2 == 0, return_token_ids=True)
            decisions.append(result.decision)
            handle = await stack.wait_handle("acme", conv, other_than=handle)
            prompt = prompt + result.output_ids() + new_ids(30, 1000 * index + turn)
        return decisions

    outcomes = await asyncio.gather(*(converse(i) for i in range(6)))
    assert all(d == ["recompute_no_handle", "pull", "pull"] for d in outcomes), outcomes
    assert await pulled(stack) == pulled_before + 12
    assert await verify_failures(stack) == 0


# -- isolation ------------------------------------------------------------------------------


async def test_client_kv_transfer_params_have_no_effect(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(300, 4)
    await complete(stack, "acme", conv, prompt)
    await stack.wait_handle("acme", conv)
    state = json.loads(await stack.decode.get(stack.session, "/sim/state"))
    retained = state["retained"]
    assert retained
    forged = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": state["engine_id"],
        "remote_request_id": retained[-1]["request_id"],
        "remote_block_ids": [list(range(20))],
        "remote_host": "127.0.0.1",
        "remote_port": state["side_channel_port"],
        "remote_num_tokens": 300,
    }
    pulled_before = await pulled(stack)
    other = conversation()
    result = await complete(stack, "globex", other, prompt + new_ids(20, 5), kv_transfer_params=forged)
    assert result.decision == "recompute_no_handle"
    params = last_prefill_params(stack)
    assert params["remote_engine_id"] is None and params["kvplane_tenant"] == "globex"
    assert await pulled(stack) == pulled_before


async def test_two_tenants_with_one_conversation_id_never_share_kv(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(300, 6)
    first = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    await stack.wait_handle("acme", conv)
    continuation = prompt + first.output_ids() + new_ids(30, 7)
    pulled_before = await pulled(stack)
    # globex sends exactly what continues acme's history, under the same conversation id.
    theirs = await complete(stack, "globex", conv, continuation)
    assert theirs.decision == "recompute_no_handle"
    assert last_prefill_params(stack)["remote_engine_id"] is None
    assert await pulled(stack) == pulled_before
    # acme's own handle is still there for acme (globex's recompute left it alone). P's prefix
    # cache now holds the tokens globex sent, so P may read nothing: only the handle given to it is checked.
    ours = await complete(stack, "acme", conv, continuation)
    assert ours.decision == "pull"
    params = last_prefill_params(stack)
    assert params["kvplane_tenant"] == "acme" and params["remote_engine_id"]


# -- identity -----------------------------------------------------------------------------------


async def test_conversation_id_precedence_and_body_field_removed(stack: GatewayStack) -> None:
    body = {"model": MODEL, "prompt": new_ids(20, 8), "max_tokens": 2, "conversation_id": "from-body"}
    cases = [
        ({"X-Conversation-Id": "from-header", "X-Session-ID": "from-session"}, "from-header"),
        ({"X-Session-ID": "from-session"}, "from-session"),
        ({}, "from-body"),
    ]
    for extra, expected in cases:
        result = await stack.post("/v1/completions", dict(body), stack.headers("acme", None, **extra))
        assert result.status == 200, result.raw
        assert result.headers["x-kvplane-conversation"] == expected
        sent = stack.proxy.seen[-1].body
        assert "conversation_id" not in sent
        assert sent["kv_transfer_params"]["kvplane_conversation"] == expected


async def test_a_request_without_a_conversation_id_frees_its_kv_once_answered(stack: GatewayStack) -> None:
    name = "kvplane_gateway_leg_seconds_count"
    released = await stack.gateway_metric(name, leg="end_conversation", outcome="released")
    held_before = await retained_ids(stack)
    body = {"model": MODEL, "prompt": new_ids(200, 18), "max_tokens": 4}
    result = await stack.post("/v1/completions", body, stack.headers("acme"))
    assert result.status == 200, result.raw
    assert result.headers["x-kvplane-conversation"].startswith("ephemeral-")

    async def freed() -> bool:
        count = await stack.gateway_metric(name, leg="end_conversation", outcome="released")
        # D freed the turn's blocks: released through routing, then by the engine on its command.
        return count == released + 1 and await retained_ids(stack) <= held_before

    await eventually(freed, timeout_s=10, what="D to free the one-off conversation's blocks")


async def test_requests_without_a_valid_key_are_refused(stack: GatewayStack) -> None:
    body = {"model": MODEL, "prompt": new_ids(20, 9), "max_tokens": 2}
    seen = len(stack.proxy.seen)
    missing = await stack.post("/v1/completions", body, {"X-Conversation-Id": "c"})
    wrong = await stack.post("/v1/completions", body, {"X-Conversation-Id": "c", "x-api-key": "nope"})
    assert (missing.status, wrong.status) == (401, 401)
    assert len(stack.proxy.seen) == seen


# -- tracing --------------------------------------------------------------------------------------


async def test_one_trace_per_turn_spans_route_and_both_legs_and_its_held_report_goes_apart(
    stack: GatewayStack,
) -> None:
    conv = conversation()
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4736"
    headers = stack.headers("acme", conv, traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
    body = {"model": MODEL, "prompt": new_ids(50, 21), "max_tokens": 2}
    result = await stack.post("/v1/completions", body, headers)
    assert result.status == 200, result.raw

    def ours() -> dict[str, Any]:
        spans = stack.spans.get_finished_spans()
        return {s.name: s for s in spans if f"{s.context.trace_id:032x}" == trace_id}

    async def complete_trace() -> bool:
        wanted = {"gateway.turn", "gateway.prefill", "gateway.decode"}
        return wanted <= set(ours()) and len(ours()) >= 4

    await eventually(complete_trace, timeout_s=10, what="the turn's spans")
    spans = ours()
    # The turn's report is held for a later Route or a ReportTurns of many turns: no one turn's.
    assert {n for n in spans if "RoutingService" in n} == {"/kvplane.v1.RoutingService/Route"}

    async def batch_sent() -> bool:
        names = {s.name for s in stack.spans.get_finished_spans()}
        return "/kvplane.v1.RoutingService/ReportTurns" in names

    await eventually(batch_sent, timeout_s=10, what="the held report's ReportTurns")
    # The caller's span is the turn's parent, and the turn is the parent of everything it does.
    turn_span = spans["gateway.turn"]
    assert turn_span.parent.span_id == 0x00F067AA0BA902B7
    for name, span in spans.items():
        if name != "gateway.turn":
            assert span.parent.span_id == turn_span.context.span_id, name


# -- faults ---------------------------------------------------------------------------------------


async def test_failed_prefill_is_retried_once_without_the_handle(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(300, 11)
    first = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    handle = await stack.wait_handle("acme", conv)
    retries_metric = "kvplane_gateway_retries_total"
    retries = await stack.gateway_metric(retries_metric, reason="prefill_http_500")
    seen = len(stack.proxy.seen)
    stack.proxy.fail_next(500)
    prompt = prompt + first.output_ids() + new_ids(30, 12)
    second = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    assert second.decision == "retry_no_handle"
    attempts = [r.body["kv_transfer_params"] for r in stack.proxy.seen[seen:]]
    assert len(attempts) == 2
    assert attempts[0]["remote_engine_id"] and attempts[1]["remote_engine_id"] is None
    assert (
        await stack.gateway_metric("kvplane_gateway_retries_total", reason="prefill_http_500") == retries + 1
    )
    # The retried turn's D retained a new handle: the next turn pulls again.
    await stack.wait_handle("acme", conv, other_than=handle)
    third = await complete(stack, "acme", conv, prompt + second.output_ids() + new_ids(30, 13))
    assert third.decision == "pull"


async def test_prefill_past_its_deadline_is_retried(stack: GatewayStack) -> None:
    stack.proxy.stall_next(stack.gateway.settings.prefill_timeout_s + 1.0)
    result = await complete(stack, "acme", conversation(), new_ids(100, 14))
    assert result.decision == "retry_no_handle"
    assert await stack.gateway_metric("kvplane_gateway_retries_total", reason="prefill_timeout") >= 1


async def test_routing_restart_mid_conversation_fails_no_turn(stack: GatewayStack) -> None:
    conv = conversation()
    prompt = new_ids(300, 15)
    first = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    handle = await stack.wait_handle("acme", conv)
    await stack.stop_routing()
    prompt = prompt + first.output_ids() + new_ids(30, 16)
    second = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    # Without routing the static pair recomputes; D's connector still publishes the new handle.
    assert second.decision == "fallback"
    await stack.start_routing()
    # Until the gateway's channel reconnects (gRPC backoff, at most 2 s) turns keep falling back;
    # each one succeeds and leaves a new handle, and once routing answers the conversation pulls again.
    deadline = time.monotonic() + 15
    result, decisions = second, list[str]()
    while time.monotonic() < deadline:
        handle = await stack.wait_handle("acme", conv, other_than=handle)
        prompt = prompt + result.output_ids() + new_ids(30, len(decisions) + 17)
        result = await complete(stack, "acme", conv, prompt, return_token_ids=True)
        decisions.append(result.decision)
        if result.decision != "fallback":
            break
    assert decisions[-1] == "pull", decisions


# -- what the client is told of the prompt's tokens -------------------------------------------


def _cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


async def test_usage_cached_tokens_are_what_p_did_not_compute_not_ds_whole_prompt(
    stack: GatewayStack,
) -> None:
    conv = conversation()
    prompt = new_ids(320, seed=71)
    first = await complete(stack, "acme", conv, prompt, return_token_ids=True)
    # D imported the whole prompt from P and reports it all cached; P computed it all.
    assert _cached(first.body["usage"]) == 0
    history = [*prompt, *first.output_ids()]
    follow_up = [*history, *new_ids(64, seed=72)]
    second = await complete(
        stack,
        "acme",
        conv,
        follow_up,
        stream=True,
        stream_options={"include_usage": True},
        return_token_ids=True,
    )
    (usage,) = [e["usage"] for _, e in second.events if e.get("usage")]
    p_said = stack.proxy.seen[-1]
    assert p_said.path.endswith("/v1/completions")
    cached = _cached(usage)
    # What P reused (its cache or the pull from D) is some of the history, never the new turn.
    assert 0 < cached <= len(history) < usage["prompt_tokens"]
