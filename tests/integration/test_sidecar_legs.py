"""The sidecar's legs against a stand-in prefill engine on loopback: what a failed P leg means."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvplane.services.client import Endpoint, RouteResult
from kvplane.services.common.model.handles import KEY_RETAIN
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.turn_errors import TurnFailed
from kvplane.services.sidecar.signed_route import SignedRoute
from kvplane.services.sidecar.turn import SidecarLegs
from kvplane.v1 import routing_pb2


class FakePrefill:
    def __init__(self) -> None:
        self.status = 200
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        if self.status != 200:
            return web.json_response({"error": {"message": "no", "code": self.status}}, status=self.status)
        usage = {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
        return web.json_response({"usage": usage, "kv_transfer_params": {"remote_block_ids": [4]}})


@pytest.fixture
async def legs() -> AsyncIterator[tuple[SidecarLegs, FakePrefill, SignedRoute]]:
    fake = FakePrefill()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    route = RouteResult(
        route_id="r",
        decision="pull",
        reason="",
        prefill=Endpoint("p", f"http://127.0.0.1:{port}", "i"),
        decode=Endpoint("d", "http://127.0.0.1:1", "i"),
        prefill_params={"remote_block_ids": [1], "kvplane_tenant": "acme", "kvplane_conversation": "c"},
        expected_reused_tokens=0,
        response=routing_pb2.RouteResponse(),
    )
    telemetry = Telemetry.disabled()
    async with aiohttp.ClientSession() as session:
        yield (
            SidecarLegs(
                GatewaySection(),
                "http://127.0.0.1:1",
                session,
                telemetry.tracer,
                GatewayMetrics.create(telemetry.registry),
            ),
            fake,
            SignedRoute(route, return_token_ids=True),
        )
    await runner.cleanup()


async def test_p_runs_with_the_routes_params_and_d_gets_ps(
    legs: tuple[SidecarLegs, FakePrefill, SignedRoute],
) -> None:
    sidecar, fake, signed = legs
    decode = await sidecar.prefill(
        signed, {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "return_token_ids": True}, chat=False
    )
    assert fake.seen[0]["kv_transfer_params"] == signed.route.prefill_params
    assert fake.seen[0]["max_tokens"] == 1 and fake.seen[0]["stream"] is False
    # P is not asked for the prompt's ids (nothing reads them from its answer); D is, as routed.
    assert "return_token_ids" not in fake.seen[0]
    assert decode.body["kv_transfer_params"]["remote_block_ids"] == [4]
    assert decode.body["kv_transfer_params"]["kvplane_tenant"] == "acme"
    assert decode.body["return_token_ids"] is True and decode.body["max_tokens"] == 50
    assert decode.report is not None and decode.report.params == {"remote_block_ids": [4]}
    assert sidecar.metrics.legs.labels("prefill", "ok")._sum.get() > 0


async def test_a_request_p_rejects_fails_with_ps_answer(
    legs: tuple[SidecarLegs, FakePrefill, SignedRoute],
) -> None:
    sidecar, fake, signed = legs
    fake.status = 400
    with pytest.raises(TurnFailed) as failed:
        await sidecar.prefill(signed, {"prompt": [1]}, chat=False)
    assert failed.value.status == 400 and b"no" in failed.value.body


async def test_a_failing_p_leaves_d_to_compute_the_prompt(
    legs: tuple[SidecarLegs, FakePrefill, SignedRoute],
) -> None:
    sidecar, fake, signed = legs
    fake.status = 500
    decode = await sidecar.prefill(signed, {"prompt": [1], "kv_transfer_params": {"x": 1}}, chat=False)
    assert "kv_transfer_params" not in decode.body
    assert decode.report is not None and decode.report.decision == "retry_no_handle"
    assert "HTTP 500" in decode.report.error


async def test_a_route_prefill_on_decode_gives_d_the_routes_params_and_runs_no_p_leg(
    legs: tuple[SidecarLegs, FakePrefill, SignedRoute],
) -> None:
    sidecar, fake, signed = legs
    params = {"kvplane_tenant": "acme", "kvplane_conversation": "c", "kvplane_handle": "h"}
    route = dataclasses.replace(signed.route, decision="prefill_on_decode", prefill_params=params)
    client = {"prompt": [1, 2], "max_tokens": 9, "kv_transfer_params": {"remote_host": "evil"}}
    body = sidecar.on_decode(client, SignedRoute(route, return_token_ids=True))
    assert body["kv_transfer_params"] == params and body["max_tokens"] == 9
    assert body["return_token_ids"] is True
    assert fake.seen == []
    skip = dataclasses.replace(route, skip_decode_retention=True)
    assert sidecar.on_decode(client, SignedRoute(skip, return_token_ids=False))["kv_transfer_params"] == {
        **params,
        KEY_RETAIN: False,
    }
