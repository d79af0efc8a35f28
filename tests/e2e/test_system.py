"""The whole system as `make run` starts it: real etcd, `kvplane serve all`, a P and a D
sim-engine with real NIXL, and the gateway, each its own process.

Turns go through the gateway's OpenAI API with token-id prompts (what a gateway
should send); decisions come from the gateway's `x-kvplane-decision` header, and
the engines' own metrics say whether every pulled block verified.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from kvplane.services.devstack.demo import run_demo
from kvplane.services.devstack.names import DEMO_MODEL
from kvplane.services.devstack.processes import grpc_health_probe
from kvplane.services.devstack.stack import DEMO_API_KEY, Stack, start_stack
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.support.polling import eventually

pytestmark = pytest.mark.e2e

# Long enough answers that P's missing tail (D's output) is over vLLM's 64-token
# recompute threshold, so P really pulls it rather than recomputing the tail.
MAX_TOKENS = 80


# P's prefix cache holds each turn's prompt, so a later turn lacks only D's answer there, which
# routing's calibrated cost model recomputes rather than pulls. These tests are about pulls: with
# no fixed cost per transfer (configured, never learned) and no margin a pull must save beyond it
# (`pull.min_saving_ms`), every tail over vLLM's threshold pays.
# Samples are clamped to the configured estimates (max_sample_factor 1): on a loaded machine the
# learned rates would otherwise drift with the load over the module's turns, and with them the
# decisions these tests are about.
PULL_POLICY = (
    resources.files("kvplane.services.routing.policy")
    .joinpath("default_policy.yaml")
    .read_text(encoding="utf-8")
    .replace("max_transfer_fraction: 0.5", "max_transfer_fraction: 1.0")
    .replace("transfer_overhead_ms: 10.0", "transfer_overhead_ms: 0.01")
    .replace("min_saving_ms: 10.0", "min_saving_ms: 0.0")
    .replace("handshake_ms: 20.0", "handshake_ms: 0.01\n  max_sample_factor: 1.0")
)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    run_dir = tmp_path_factory.mktemp("stack")
    policy = run_dir / "pull_policy.yaml"
    policy.write_text(PULL_POLICY)
    # `serve all` reads its settings from the environment it inherits, also when a test restarts it.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPLANE_ROUTING__POLICY_FILE", str(policy))
        # Its gateways send every turn through P (the decode-prefill gateway's turns may go to D
        # alone): these tests are about the P leg.
        running = await start_stack(
            run_dir,
            speedup=1.0,
            timeout_s=240,
            colocated_routing=True,
            decode_prefill_gateway=True,
            gateway_prefill_on_decode=False,
        )
        try:
            yield running
        finally:
            running.stop()


@dataclass
class Conversation:
    """A token-id conversation: each turn's prompt is the last prompt, its output, and new user ids."""

    name: str
    rng: random.Random
    prompt: list[int] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)

    def next_user(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 30000) for _ in range(n)]


async def turn(
    session: aiohttp.ClientSession,
    stack: Stack,
    conv: Conversation,
    prompt: list[int],
    *,
    stream: bool,
    key: str = DEMO_API_KEY,
    extra: dict[str, Any] | None = None,
    gateway_url: str = "",
) -> tuple[str, list[int]]:
    """One completion through the gateway (`gateway_url`, else the stack's); returns the decision
    and the output token ids."""
    body: dict[str, Any] = {
        "model": DEMO_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **(extra or {}),
    }
    headers = {"Authorization": f"Bearer {key}", "X-Conversation-Id": conv.name}
    url = f"{gateway_url or stack.gateway_url}/v1/completions"
    async with session.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        decision = resp.headers.get("x-kvplane-decision", "")
        output: list[int] = []
        if not stream:
            payload = await resp.json()
            assert "kv_transfer_params" not in payload
            output = list(payload["choices"][0]["token_ids"])
        else:
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "kv_transfer_params" not in chunk
                for choice in chunk.get("choices", []):
                    output += choice.get("token_ids") or []
    assert len(output) == MAX_TOKENS
    return decision, output


async def engine_counter(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            metric, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in metric for k, v in labels.items()):
                total += float(value)
    return total


async def run_conversation(
    session: aiohttp.ClientSession,
    stack: Stack,
    conv: Conversation,
    turns: int,
    *,
    stream: bool,
    gateway_url: str = "",
) -> None:
    # Long enough that pulling beats recomputing by the calibrated cost model,
    # even on the first contact with the holder (handshake included).
    conv.prompt = conv.next_user(3000)
    for _ in range(turns):
        decision, output = await turn(
            session, stack, conv, conv.prompt, stream=stream, gateway_url=gateway_url
        )
        conv.decisions.append(decision)
        conv.prompt = conv.prompt + output + conv.next_user(150)


async def test_twenty_concurrent_five_turn_conversations_pull_and_verify(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        failures_before = await engine_counter(
            session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total"
        )
        pulled_before = await engine_counter(
            session, stack.prefill_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        convs = [Conversation(f"e2e-{i}", random.Random(i)) for i in range(20)]
        await asyncio.gather(
            *[run_conversation(session, stack, c, 5, stream=(i % 2 == 0)) for i, c in enumerate(convs)]
        )
        for conv in convs:
            assert conv.decisions[0].startswith("recompute"), conv.decisions
            assert conv.decisions[1:] == ["pull"] * 4, (conv.name, conv.decisions)
        assert (
            await engine_counter(session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total")
            == failures_before
        )
        pulled = await engine_counter(
            session, stack.prefill_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        assert pulled - pulled_before >= 20 * 4 * 64


async def test_a_gateway_routing_in_its_own_process_pulls_and_verifies(stack: Stack) -> None:
    # The colocated gateway is a routing replica itself: the engines stream to it, and its turns
    # are routed there (its own metrics count them), not by serve all's replica.
    url = stack.colocated_gateway_url
    async with aiohttp.ClientSession() as session:
        failures_before = await engine_counter(
            session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total"
        )
        convs = [Conversation(f"colocated-{i}", random.Random(500 + i)) for i in range(4)]
        await asyncio.gather(
            *[
                run_conversation(session, stack, c, 4, stream=(i % 2 == 0), gateway_url=url)
                for i, c in enumerate(convs)
            ]
        )
        for conv in convs:
            assert conv.decisions[0].startswith("recompute"), conv.decisions
            assert conv.decisions[1:] == ["pull"] * 3, (conv.name, conv.decisions)
        assert (
            await engine_counter(session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total")
            == failures_before
        )
        routed = await engine_counter(session, url, "kvplane_routes_total", decision="pull")
        assert routed >= 4 * 3
        assert await engine_counter(session, url, "kvplane_routing_node_streams") == 2


async def test_a_gateway_that_lets_d_prefill_short_turns_skips_p_and_chains_d_handles(stack: Stack) -> None:
    # Through the decode-prefill gateway, a later turn that adds 50 tokens to what D holds is
    # prefilled by D itself: P is sent nothing, D's own cache serves the history, D keeps the new
    # turn as the conversation's handle, and the handle it supersedes is released. P computed the
    # first prompt only, so it lacks D's 80-token answer, more than the turn adds: the default
    # policy's `min_history_per_new_token` (1) lets D prefill. Each turn D prefills widens P's gap.
    url = stack.decode_prefill_gateway_url
    conv = Conversation("decode-prefill-0", random.Random(900))
    async with aiohttp.ClientSession() as session:

        async def counters() -> tuple[float, float, float]:
            p_prompt = await engine_counter(session, stack.prefill_url, "vllm:prompt_tokens_total")
            d_hit = await engine_counter(
                session, stack.decode_url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
            )
            released = await engine_counter(
                session, stack.decode_url, "kvplane_sim_retained_frees_total", kind="decode_handle"
            )
            return p_prompt, d_hit, released

        conv.prompt = conv.next_user(3000)
        decision, output = await turn(session, stack, conv, conv.prompt, stream=False, gateway_url=url)
        assert decision.startswith("recompute")
        conv.prompt = conv.prompt + output + conv.next_user(50)
        p_before, hit_before, released_before = await counters()
        for _ in range(3):
            decision, output = await turn(session, stack, conv, conv.prompt, stream=True, gateway_url=url)
            conv.decisions.append(decision)
            conv.prompt = conv.prompt + output + conv.next_user(50)
        assert conv.decisions == ["prefill_on_decode"] * 3
        p_after, hit_after, _ = await counters()
        assert p_after == p_before, "a turn D prefilled itself reached P"
        assert hit_after - hit_before >= 3 * 3000

        # Each turn's handle superseded the one before: those three are freed, not left to their TTL.
        async def released_three() -> bool:
            return (await counters())[2] - released_before >= 3

        await eventually(released_three, timeout_s=30, what="D's superseded handles to be released")


async def test_a_forked_conversation_is_prefilled_by_the_decode_node_whose_events_show_its_history(
    stack: Stack,
) -> None:
    # A conversation forked from another (an agent's sub-task, a regenerated branch) has no handle
    # of its own, but D's prefix cache holds the history it shares, as D's KV events tell routing.
    # Through the decode-prefill gateway D prefills the fork itself: P is sent nothing. P computed
    # the first prompt only, so it lacks D's 80-token answer, more than the fork adds.
    url = stack.decode_prefill_gateway_url
    routing = stack.metrics_url.removesuffix("/metrics")
    blocks = "kvplane_routing_engine_cache_blocks"
    async with aiohttp.ClientSession() as session:
        parent = Conversation("fork-parent", random.Random(3131))
        parent.prompt = parent.next_user(3000)
        seen: list[float] = []

        async def d_view_settled() -> bool:
            # Earlier tests' last blocks may still be on their way to routing: start from a view
            # that has not changed for a second (several of the agent's 100 ms flushes).
            seen.append(await engine_counter(session, routing, blocks, node="d0"))
            return len(seen) >= 3 and seen[-1] == seen[-3]

        await eventually(d_view_settled, timeout_s=30, interval_s=0.5, what="routing's view of D to settle")
        held_before = seen[-1]
        decision, output = await turn(session, stack, parent, parent.prompt, stream=False, gateway_url=url)
        assert decision.startswith("recompute")

        async def d_blocks_seen() -> bool:
            # D's view in routing has grown by the parent's whole blocks, its answer's included
            # (they enter D's cache as the turn ends; the answer's last token has no KV yet).
            whole = (len(parent.prompt) + len(output) - 1) // 16
            return await engine_counter(session, routing, blocks, node="d0") >= held_before + whole

        await eventually(d_blocks_seen, timeout_s=30, what="routing to hear D's KV events of the turn")
        p_before = await engine_counter(session, stack.prefill_url, "vllm:prompt_tokens_total")
        hit_before = await engine_counter(
            session, stack.decode_url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
        )
        fork = Conversation("fork-child", random.Random(3132))
        fork.prompt = parent.prompt + output + fork.next_user(50)
        decision, _ = await turn(session, stack, fork, fork.prompt, stream=True, gateway_url=url)
        assert decision == "prefill_on_decode"
        assert await engine_counter(session, stack.prefill_url, "vllm:prompt_tokens_total") == p_before
        hits = (
            await engine_counter(
                session, stack.decode_url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
            )
            - hit_before
        )
        assert hits >= 3000


async def test_a_conversation_moving_between_the_stacks_gateways_finds_its_history_in_ps_cache(
    stack: Stack,
) -> None:
    # Each gateway salts P's prefix cache per tenant (cache_salt); the stack's gateways share the
    # salt's key, so a turn through the other gateway is the same tenant to P.
    cached = "vllm:prompt_tokens_by_source_total"
    async with aiohttp.ClientSession() as session:
        conv = Conversation("two-gateways", random.Random(4242))
        conv.prompt = conv.next_user(2000)
        _, out = await turn(session, stack, conv, conv.prompt, stream=False)
        before = await engine_counter(session, stack.prefill_url, cached, source="local_cache_hit")
        second = conv.prompt + out + conv.next_user(200)
        await turn(session, stack, conv, second, stream=True, gateway_url=stack.colocated_gateway_url)
        hits = await engine_counter(session, stack.prefill_url, cached, source="local_cache_hit") - before
        # Every whole block of the first prompt, which P computed, is found in its cache (16-token
        # blocks; the last may be left to compute).
        assert hits >= (len(conv.prompt) // 16 - 1) * 16, hits


async def test_stripped_reasoning_never_uses_an_unverified_block(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        conv = Conversation("stripped", random.Random(99))
        conv.prompt = conv.next_user(3000)
        _, out1 = await turn(session, stack, conv, conv.prompt, stream=False)
        second = conv.prompt + out1 + conv.next_user(200)
        decision2, out2 = await turn(session, stack, conv, second, stream=False)
        assert decision2 == "pull"
        failures_before = await engine_counter(
            session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total"
        )
        # The client drops the start of the last answer (its reasoning) before the next turn.
        third = second + out2[MAX_TOKENS // 2 :] + conv.next_user(200)
        decision3, _ = await turn(session, stack, conv, third, stream=True)
        assert decision3 in ("recompute_prefix_mismatch", "pull"), decision3
        assert (
            await engine_counter(session, stack.prefill_url, "kvplane_sim_kv_verify_failures_total")
            == failures_before
        )


async def test_client_kv_transfer_params_have_no_effect(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        conv = Conversation("forged", random.Random(7))
        forged = {
            "do_remote_prefill": True,
            "remote_engine_id": "someone-else",
            "remote_block_ids": [[1, 2, 3]],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
            "remote_request_id": "stolen",
            "remote_num_tokens": 48,
        }
        decision, _ = await turn(
            session, stack, conv, conv.next_user(300), stream=False, extra={"kv_transfer_params": forged}
        )
        assert decision.startswith("recompute")


async def _incarnation(stack: Stack, node_id: str) -> str:
    async with grpc.aio.insecure_channel(stack.grpc_target) as channel:
        nodes = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
            metadata_pb2.ListNodesRequest(), metadata=stack.operator_metadata
        )
    return next((n.node.incarnation for n in nodes.nodes if n.node.node_id == node_id), "")


async def test_decode_engine_killed_between_turns_next_turn_recomputes(stack: Stack) -> None:
    decode = next(p for p in stack.processes if p.name == "decode sim-engine")
    async with aiohttp.ClientSession() as session:
        conv = Conversation("d-killed", random.Random(5))
        conv.prompt = conv.next_user(3000)
        _, out = await turn(session, stack, conv, conv.prompt, stream=False)
        conv.prompt = conv.prompt + out + conv.next_user(100)
        before = await _incarnation(stack, "d0")
        assert before
        assert decode.proc is not None
        decode.proc.send_signal(signal.SIGKILL)
        decode.proc.wait()
        decode.start()  # the same node comes back as a new incarnation

        async def reborn() -> bool:
            now = await _incarnation(stack, "d0")
            return bool(now) and now != before

        await eventually(reborn, timeout_s=120, what="decode engine registered as a new incarnation")
        decision, _ = await turn(session, stack, conv, conv.prompt, stream=True)
        assert decision.startswith("recompute"), decision


async def test_services_restart_mid_conversation(stack: Stack) -> None:
    services = next(p for p in stack.processes if p.name == "kvplane serve all")
    async with aiohttp.ClientSession() as session:
        conv = Conversation("svc-restart", random.Random(11))
        conv.prompt = conv.next_user(3000)
        _, out = await turn(session, stack, conv, conv.prompt, stream=False)
        conv.prompt = conv.prompt + out + conv.next_user(100)
        services.stop()
        # While routing is down the gateway serves from its fallback pair: the turn still succeeds.
        decision, out = await turn(session, stack, conv, conv.prompt, stream=False)
        assert decision.startswith("recompute") or decision == "fallback", decision
        conv.prompt = conv.prompt + out + conv.next_user(100)
        services.start()
        await eventually(grpc_health_probe(stack.grpc_target), timeout_s=120, what="services back")

        async def pulls_again() -> bool:
            nonlocal out
            decision, out = await turn(session, stack, conv, conv.prompt, stream=False)
            conv.prompt = conv.prompt + out + conv.next_user(100)
            return decision == "pull"

        await eventually(pulls_again, timeout_s=120, interval_s=1.0, what="pulls after the restart")


async def test_etcd_down_for_ten_seconds_under_load_turns_recompute_and_succeed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        convs = [Conversation(f"etcd-{i}", random.Random(100 + i)) for i in range(4)]
        for conv in convs:
            conv.prompt = conv.next_user(3000)
            _, out = await turn(session, stack, conv, conv.prompt, stream=False)
            conv.prompt = conv.prompt + out + conv.next_user(100)
        stop_load = asyncio.Event()
        outage_decisions: list[str] = []

        async def load(conv: Conversation) -> None:
            while not stop_load.is_set():
                decision, out = await turn(session, stack, conv, conv.prompt, stream=True)
                outage_decisions.append(decision)
                conv.prompt = conv.prompt + out + conv.next_user(50)

        stack.etcd.stop()
        workers = [asyncio.create_task(load(c)) for c in convs]
        try:
            await asyncio.sleep(10)  # the outage under test lasts ten seconds
        finally:
            stack.etcd.start()
            stop_load.set()
            await asyncio.gather(*workers)
        assert outage_decisions, "no turn ran during the outage"
        assert any(d.startswith("recompute") for d in outage_decisions)

        after: list[str] = []

        async def pulls_again() -> bool:
            conv = convs[0]
            decision, out = await turn(session, stack, conv, conv.prompt, stream=False)
            conv.prompt = conv.prompt + out + conv.next_user(50)
            after.append(decision)
            return decision == "pull"

        try:
            await eventually(pulls_again, timeout_s=120, interval_s=1.0, what="pulls after etcd returns")
        except AssertionError as exc:
            async with session.get(stack.metrics_url) as resp:
                costs = [line for line in (await resp.text()).splitlines() if line.startswith("kvplane_cost")]
            raise AssertionError(f"{exc}; decisions since etcd returned: {after}; {costs}") from None


async def test_make_run_demo_runs_on_the_started_stack(stack: Stack) -> None:
    turns = await run_demo(stack, conversations=1, turns=3)
    assert [t.turn for t in turns] == [1, 2, 3]
    assert turns[0].decision.startswith("recompute")
    assert all(t.ttft_ms > 0 for t in turns)
    # The second turn follows a reset of P's prefix cache: its history comes from D.
    assert [t.reset_before for t in turns] == [False, True, False]
    assert turns[1].decision == "pull" and turns[1].pulled_tokens > 0


def test_stack_logs_are_kept_in_the_run_dir(stack: Stack) -> None:
    names = {p.name for p in stack.processes}
    assert names == {
        "kvplane serve all",
        "prefill sim-engine",
        "decode sim-engine",
        "gateway",
        "colocated gateway",
        "decode-prefill gateway",
    }
    assert all(Path(p.log_path).exists() for p in stack.processes)
