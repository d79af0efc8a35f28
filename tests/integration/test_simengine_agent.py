"""Sim-engines on the real metadata service (real etcd): registration, publish, release, prefix check."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc

from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import OPERATOR_HEADERS
from tests.support.polling import eventually
from tests.support.simengine import Engine, d_leg, engines, free_port, loads, p_leg, sim, tokens

TENANT = "acme"


async def get_handle(channel: grpc.aio.Channel, conversation: str) -> metadata_pb2.GetHandleResponse | None:
    try:
        result: metadata_pb2.GetHandleResponse = await metadata_pb2_grpc.MetadataServiceStub(
            channel
        ).GetHandle(
            metadata_pb2.GetHandleRequest(tenant=TENANT, conversation=conversation), metadata=OPERATOR_HEADERS
        )
        return result
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


async def turn(
    p: Engine, d: Engine, prompt: list[int], conversation: str, handle: dict[str, Any] | None
) -> tuple[list[int], dict[str, Any]]:
    p_params = (await asyncio.to_thread(p_leg, p, prompt, handle))["kv_transfer_params"]
    # What kvplane's router adds to the D leg: the authenticated tenant and the conversation.
    d_params = dict(p_params, kvplane_tenant=TENANT, kvplane_conversation=conversation)
    dr = await asyncio.to_thread(d_leg, d, prompt, d_params, 100)
    return dr["choices"][0]["token_ids"], dr["kv_transfer_params"]


async def test_sim_engines_register_publish_and_report_released(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{metadata_process.grpc_port}"
    common: dict[str, Any] = {"control_plane": target, "load_interval_s": 0.1}
    specs = {
        "P": sim(role="prefill", engine_id="p-sim", node_id="p-sim", side_channel_port=free_port(), **common),
        "D": sim(role="decode", engine_id="d-sim", node_id="d-sim", side_channel_port=free_port(), **common),
    }
    stack = contextlib.ExitStack()
    try:
        cluster = await asyncio.to_thread(stack.enter_context, engines(tmp_path, specs))
        p, d = cluster["P"], cluster["D"]
        d_state = await asyncio.to_thread(d.state)
        stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)

        async def d_registered() -> metadata_pb2.NodeStatus | None:
            nodes = (await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=OPERATOR_HEADERS)).nodes
            return next(
                (n for n in nodes if n.node.node_id == "d-sim" and n.load.total_kv_blocks == 512), None
            )

        status = await eventually(d_registered, what="the D sim-engine registered with its load")
        assert status.node.incarnation == d_state["incarnation"], (
            "node and lease stamps share the incarnation"
        )
        assert status.node.side_channel_port == d_state["side_channel_port"]

        # Turn 1: D publishes its handle, with digests, under the tenant and conversation.
        prompt = tokens(21, 200)
        out, handle = await turn(p, d, prompt, "conv-a", None)
        assert handle["kvplane_digests"] and handle["kvplane_handle_id"]
        stored = await eventually(lambda: get_handle(metadata_channel, "conv-a"), what="handle published")
        assert stored.handle.handle_id == handle["kvplane_handle_id"]
        assert stored.handle.holder_node_id == "d-sim"
        assert stored.handle.holder_incarnation == d_state["incarnation"]
        assert stored.handle.vllm.remote_num_tokens == 299

        # Turn 2: P verifies the digests and pulls; D frees the blocks and reports them released.
        pulled = await asyncio.to_thread(loads, p, "pulled")
        prompt2 = prompt + out + tokens(22, 40)
        await turn(p, d, prompt2, "conv-a", handle)
        assert await asyncio.to_thread(loads, p, "pulled") == pulled + 1
        assert (
            await asyncio.to_thread(p.metric, "kvplane_connector_pull_checks_total", outcome="verified") == 1
        )

        async def released() -> bool:
            current = await get_handle(metadata_channel, "conv-a")
            return current is None or current.handle.handle_id != handle["kvplane_handle_id"]

        await eventually(released, what="the read handle reported released")

        # A stripped reasoning trace: the prefix check clips the pull to the verified blocks.
        prompt = tokens(23, 200)
        out, handle = await turn(p, d, prompt, "conv-b", None)
        edited = list(out)
        del edited[90:95]  # position 290: blocks up to 288 still verify
        fails = await asyncio.to_thread(p.metric, "kvplane_sim_kv_verify_failures_total")
        src = await asyncio.to_thread(
            p.metric, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        await turn(p, d, prompt + edited + tokens(24, 40), "conv-b", handle)
        assert await asyncio.to_thread(p.metric, "kvplane_sim_kv_verify_failures_total") == fails
        got = await asyncio.to_thread(
            p.metric, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        assert got - src == 288 - 192, "P pulls exactly the verified whole blocks beyond its own cache"
        assert (
            await asyncio.to_thread(p.metric, "kvplane_connector_pull_checks_total", outcome="clipped") == 1
        )
    finally:
        await asyncio.to_thread(stack.close)
