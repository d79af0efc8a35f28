"""Routed turns on sim-engines: metadata, routing and eviction services on real etcd, P and D as processes.

The test plays the gateway with kvplane's client helpers: Route, the P leg, the D leg, ReportTurn.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from importlib import resources
from pathlib import Path
from typing import Any

import grpc

from kvplane.services.cli import installers
from kvplane.services.client import RoutingClient
from kvplane.services.client.vllm_requests import decode_body, prefill_body
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import OPERATOR_HEADERS, settings_for, tenant_headers
from tests.support.polling import eventually
from tests.support.simengine import Engine, engines, free_port, reference, sim, tokens

MODEL = "kvplane-sim"
DEFAULT_POLICY = (
    resources.files("kvplane.services.routing.policy")
    .joinpath("default_policy.yaml")
    .read_text(encoding="utf-8")
)


def post_to(engines_by_url: dict[str, Engine], url: str, body: dict[str, Any]) -> dict[str, Any]:
    return engines_by_url[url.rstrip("/")].post("/v1/completions", body)


async def test_routed_turns_pull_from_the_sim_decode_engine(
    etcd: LocalEtcd, prefix: str, tmp_path: Path
) -> None:
    # P's prefix cache holds each turn's prompt, so only D's 100-token answer is missing there:
    # a recompute this costly per token makes that tail worth pulling, which is the path checked here.
    policy = tmp_path / "policy.yaml"
    policy.write_text(DEFAULT_POLICY.replace("recompute_ms_per_token: 0.0282", "recompute_ms_per_token: 5.0"))
    services = ServiceProcess(
        settings_for(etcd, prefix, routing={"policy_file": str(policy)}),
        installers(["metadata", "routing", "eviction"]),
        Telemetry.disabled(),
    )
    await services.start()
    target = f"127.0.0.1:{services.grpc_port}"
    stack = contextlib.ExitStack()
    try:
        # 32 MiB of KV each: a 4k-token handle stays well under eviction's default node budget.
        common: dict[str, Any] = {
            "control_plane": target,
            "load_interval_s": 0.1,
            "decoder_kv_blocks_ttl": 120,
            "num_blocks": 8192,
        }
        specs = {
            "P": sim(role="prefill", node_id="p0", side_channel_port=free_port(), **common),
            "D": sim(role="decode", node_id="d0", side_channel_port=free_port(), **common),
        }
        cluster = await asyncio.to_thread(stack.enter_context, engines(tmp_path, specs))
        p, d = cluster["P"], cluster["D"]
        by_url = {e.url: e for e in (p, d)}

        async with grpc.aio.insecure_channel(target) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)

            async def both_registered() -> bool:
                nodes = (
                    await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=OPERATOR_HEADERS)
                ).nodes
                return {n.node.node_id for n in nodes} >= {"p0", "d0"}

            await eventually(both_registered, what="both sim-engines registered")

        conversation = f"conv-{uuid.uuid4().hex[:8]}"
        # Long enough that the history is worth pulling wherever P lacks it.
        prompt = tokens(31, 4096)
        decisions: list[str] = []
        turns: list[tuple[list[int], list[int]]] = []
        async with RoutingClient([target], metadata=tenant_headers("acme"), timeout_s=5) as rc:
            for turn in range(3):
                route = await rc.route(conversation, MODEL, prompt_token_ids=prompt)
                decisions.append(route.decision)
                assert route.prefill.http_url == p.url and route.decode.http_url == d.url
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 100,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                p_body = prefill_body(body, route)
                p_resp = await asyncio.to_thread(post_to, by_url, route.prefill.http_url, p_body)
                d_body = decode_body(body, route, p_resp)
                d_resp = await asyncio.to_thread(post_to, by_url, route.decode.http_url, d_body)
                out = d_resp["choices"][0]["token_ids"]
                turns.append((prompt, out))
                handle = d_resp["kv_transfer_params"]

                async def report(route: Any = route, handle: Any = handle, n: int = len(prompt)) -> str:
                    return await rc.report_turn(
                        route,
                        conversation,
                        success=True,
                        decode_kv_transfer_params=handle,
                        prompt_tokens=n,
                        model=MODEL,
                    )

                # D's node agent publishes asynchronously; ReportTurn names the handle once routing sees it.
                published = await eventually(report, what="D's handle visible to routing")
                assert published == handle["kvplane_handle_id"]
                prompt = prompt + out + tokens(32 + turn, 60)

        assert decisions[0] == "recompute_no_handle" and decisions[1:] == ["pull", "pull"], decisions
        metric = p.metric
        assert (
            await asyncio.to_thread(metric, "kvplane_sim_kv_loads_total", leg="prefill", outcome="pulled")
            == 2
        )
        assert await asyncio.to_thread(metric, "kvplane_sim_kv_verify_failures_total") == 0
        assert await asyncio.to_thread(metric, "kvplane_connector_pull_checks_total", outcome="verified") == 2
        # Greedy output equals a single engine's; checked last, so these runs leave P's cache alone above.
        for i, (turn_prompt, out) in enumerate(turns):
            assert out == await asyncio.to_thread(reference, p, turn_prompt, 100), f"turn {i}"
    finally:
        await asyncio.to_thread(stack.close)
        await services.stop()
