"""One request through the picker, message by message, as Envoy's ext_proc stream delivers them:
refusals before and after the body, the routed answer, and the answer's way back to the client."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from pydantic import SecretStr

from kvplane.services.client import Endpoint, RouteResult, RoutingClient
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.epp import envoy_messages
from kvplane.services.epp.exchange import Exchange
from kvplane.services.epp.picker_state import PickerState
from kvplane.services.epp.response_phase import ResponseRelay
from kvplane.services.epp.settings import EppSection
from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.settings import GatewayKey, GatewaySection
from kvplane.services.gateway.tenant_share import TenantShares
from kvplane.services.gateway.turn import TurnRunner
from kvplane.services.gateway.turn_request import configured_api_keys
from kvplane.services.sidecar.prefill_report import PrefillReport
from kvplane.services.sidecar.signed_route import PREFILL_REPORT_HEADER, verify
from kvplane.v1 import routing_pb2

KEY = b"r" * 32
ROUTE = RouteResult(
    route_id="r-1",
    decision="pull",
    reason="",
    prefill=Endpoint("p", "http://10.0.0.1:8100", "i1"),
    decode=Endpoint("d", "http://10.0.0.2:8200", "i2"),
    prefill_params={"remote_block_ids": [1, 2]},
    expected_reused_tokens=0,
    response=routing_pb2.RouteResponse(),
)


@pytest.fixture
async def state() -> AsyncIterator[PickerState]:
    gateway = GatewaySection(
        api_keys=[
            GatewayKey(token=SecretStr("key-1"), tenant="acme"),
            GatewayKey(token=SecretStr("key-2"), tenant="globex"),
        ],
        max_body_bytes=1000,
        models=["m"],
    )
    telemetry = Telemetry.disabled()
    routing = RoutingClient(["127.0.0.1:1"])
    async with aiohttp.ClientSession() as session:
        turns = TurnRunner(
            gateway, routing, session, GatewayMetrics.create(telemetry.registry), telemetry.tracer
        )
        yield PickerState(
            epp=EppSection(sidecar_port=8000, body_chunk_bytes=1024),
            gateway=gateway,
            turns=turns,
            keys=configured_api_keys(gateway),
            salts=CacheSalts.create("tenant", "s" * 32, {}),
            shares=TenantShares(0),
            body_reads=TenantShares(0),
            route_key=KEY,
            route_ttl_s=30.0,
            tracer=telemetry.tracer,
        )
    await routing.close()


def headers(path: str = "/v1/completions", end: bool = False, **extra: str) -> Any:
    values = {":method": "POST", ":path": path, **extra}
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map, end_of_stream=end))


def body(raw: bytes, end: bool = True) -> Any:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))


def status_of(responses: list[Any]) -> int:
    assert len(responses) == 1 and responses[0].HasField("immediate_response")
    return int(responses[0].immediate_response.status.code)


AUTH = {"authorization": "Bearer key-1"}


async def test_a_request_without_a_key_is_refused_on_its_headers(state: PickerState) -> None:
    exchange = Exchange(state)
    answer = await exchange.handle(headers())
    assert status_of(answer) == 401
    assert json.loads(answer[0].immediate_response.body)["error"]["type"] == "AuthenticationError"


@pytest.mark.parametrize(
    ("message", "status"),
    [
        (headers("/v1/models", **AUTH), 404),
        (headers(**AUTH, **{"content-length": "5000"}), 413),
        (headers(end=True, **AUTH), 400),
    ],
)
async def test_requests_refused_on_their_headers(state: PickerState, message: Any, status: int) -> None:
    assert status_of(await Exchange(state).handle(message)) == status


async def test_a_body_past_the_limit_is_refused_while_it_arrives(state: PickerState) -> None:
    exchange = Exchange(state)
    assert await exchange.handle(headers(**AUTH)) == []
    assert await exchange.handle(body(b"x" * 600, end=False)) == []
    assert status_of(await exchange.handle(body(b"x" * 600, end=False))) == 413


@pytest.mark.parametrize(
    ("raw", "param"), [(b'{"prompt": [1', None), (b'{"prompt": []}', "prompt"), (b"[1]", None)]
)
async def test_a_malformed_body_is_answered_400_in_openai_format(
    state: PickerState, raw: bytes, param: str | None
) -> None:
    exchange = Exchange(state)
    await exchange.handle(headers(**AUTH))
    answer = await exchange.handle(body(raw))
    assert status_of(answer) == 400
    assert json.loads(answer[0].immediate_response.body)["error"]["param"] == param


def routed_to(state: PickerState, *routes: RouteResult) -> list[tuple[str, ...]]:
    """Routing answers `routes` in turn; returns the `failed` node ids each call named."""
    asked: list[tuple[str, ...]] = []
    pending = list(routes)

    async def route(
        turn: Any, prompt: Any, failed: tuple[str, ...] = (), avoid_urls: Any = ()
    ) -> RouteResult:
        asked.append(failed)
        return pending.pop(0)

    state.turns.routing.route = route  # type: ignore[method-assign]
    state.turns.reporter.report_later = lambda *a, **k: None  # type: ignore[method-assign]
    return asked


async def test_a_routed_request_goes_to_ds_sidecar_with_the_signed_route(state: PickerState) -> None:
    routed_to(state, ROUTE)
    exchange = Exchange(state)
    await exchange.handle(headers(**AUTH, **{"x-kvplane-route": "forged", "x-conversation-id": "c-1"}))
    client = {"model": "m", "prompt": [5, 6, 7], "kv_transfer_params": {"remote_host": "evil"}}
    answer = await exchange.handle(body(json.dumps(client).encode()))
    mutation = answer[0].request_headers.response
    assert mutation.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.header_mutation.set_headers}
    assert set_headers["x-gateway-destination-endpoint"] == "10.0.0.2:8000"
    assert set_headers["x-prefiller-host-port"] == "10.0.0.1:8100"
    assert "authorization" in mutation.header_mutation.remove_headers
    lb = answer[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.2:8000"
    forwarded = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in answer[1:])
    assert answer[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    sent = json.loads(forwarded)
    assert "kv_transfer_params" not in sent and sent["prompt"] == [5, 6, 7] and sent["cache_salt"]
    signed = verify(KEY, set_headers["x-kvplane-route"], body=forwarded, now=0.0)
    assert signed.route.prefill_params == ROUTE.prefill_params
    assert set_headers["content-length"] == str(len(forwarded))


async def test_a_route_prefill_on_decode_names_no_prefill_engine(state: PickerState) -> None:
    on_decode = dataclasses.replace(
        ROUTE, decision="prefill_on_decode", prefill_params={"kvplane_tenant": "acme"}
    )
    routed_to(state, on_decode)
    exchange = Exchange(state)
    await exchange.handle(headers(**AUTH, **{"x-prefiller-host-port": "10.9.9.9:80"}))
    answer = await exchange.handle(body(json.dumps({"model": "m", "prompt": [5, 6, 7]}).encode()))
    mutation = answer[0].request_headers.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert set_headers["x-gateway-destination-endpoint"] == "10.0.0.2:8000"
    assert "x-prefiller-host-port" not in set_headers
    assert "x-prefiller-host-port" in mutation.remove_headers  # the client's is not passed on
    forwarded = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in answer[1:])
    signed = verify(KEY, set_headers["x-kvplane-route"], body=forwarded, now=0.0)
    assert signed.route.on_decode and signed.route.prefill_params == {"kvplane_tenant": "acme"}


async def test_fields_the_engines_do_not_accept_never_reach_the_sidecar(state: PickerState) -> None:
    extended = dataclasses.replace(
        state, gateway=state.gateway.model_copy(update={"pass_through_fields": ["engine_extension"]})
    )
    routed_to(extended, ROUTE)
    exchange = Exchange(extended)
    await exchange.handle(headers(**AUTH))
    client = {"model": "m", "prompt": [5, 6, 7], "seed": 3, "x": [[], []], "engine_extension": 1}
    answer = await exchange.handle(body(json.dumps(client).encode()))
    forwarded = b"".join(m.request_body.response.body_mutation.streamed_response.body for m in answer[1:])
    sent = json.loads(forwarded)
    assert "x" not in sent and sent["seed"] == 3 and sent["engine_extension"] == 1
    [counted] = [
        sample.value
        for sample in state.turns.metrics.dropped_fields.collect()[0].samples
        if sample.name == "kvplane_gateway_dropped_fields_total"
    ]
    assert counted == 1


async def test_a_route_outside_the_subset_hint_is_routed_again_then_refused(state: PickerState) -> None:
    asked = routed_to(state, ROUTE, ROUTE, ROUTE)
    exchange = Exchange(state)
    message = headers(**AUTH)
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.9:8000"]})
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    await exchange.handle(message)
    assert status_of(await exchange.handle(body(b'{"model": "m", "prompt": [1]}'))) == 503
    assert asked == [(), ("d",), ("d", "d")]


async def test_the_answer_loses_ds_handle_and_the_prefill_report(state: PickerState) -> None:
    routed_to(state, ROUTE)
    finished: list[bool] = []
    state.turns.reporter.finish = lambda turn, route, progress, success, error="": finished.append(success)  # type: ignore[method-assign]
    exchange = Exchange(state)
    await exchange.handle(headers(**AUTH, **{"x-conversation-id": "c-2"}))
    await exchange.handle(body(b'{"model": "m", "prompt": [1, 2], "stream": true}'))
    assert isinstance(exchange.relay, ResponseRelay)
    report = PrefillReport({"prompt_tokens": 2}, {"remote_block_ids": [9]}, 0.01).encode()
    head = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200"),
            base_pb2.HeaderValue(key=PREFILL_REPORT_HEADER, raw_value=report.encode()),
        ]
    )
    answered = await exchange.handle(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=head)))
    mutation = answered[0].response_headers.response.header_mutation
    assert PREFILL_REPORT_HEADER in mutation.remove_headers
    assert {h.header.key: h.header.raw_value for h in mutation.set_headers}["x-kvplane-decision"] == b"pull"
    events = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"choices": [{"text": "b", "finish_reason": "length"}], '
        b'"kv_transfer_params": {"kvplane_handle_id": "h"}}\n\n'
        b"data: [DONE]\n\n"
    )
    out = []
    for i in range(0, len(events), 7):
        chunk = events[i : i + 7]
        end = i + 7 >= len(events)
        for m in await exchange.handle(
            ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=end))
        ):
            out.append(m.response_body.response.body_mutation.streamed_response.body)
    relayed = b"".join(out)
    assert b"kv_transfer_params" not in relayed and relayed.endswith(b"data: [DONE]\n\n")
    assert relayed.count(b"data: ") == 3
    assert finished == [True]
    assert state.turns.reporter.awaited(exchange.relay.turn) == ("h", 0)
    exchange.close()
    assert finished == [True]


def test_immediate_answers_are_openai_errors() -> None:
    answer = envoy_messages.immediate(429, "slow down")
    assert answer.immediate_response.status.code == 429
    assert json.loads(answer.immediate_response.body)["error"]["type"] == "RateLimitError"


async def test_a_trusted_header_names_the_tenant_when_the_operator_says_so(state: PickerState) -> None:
    trusted = dataclasses.replace(state, epp=state.epp.model_copy(update={"tenant_source": "header"}))
    routed_to(trusted, ROUTE)
    exchange = Exchange(trusted)
    assert await exchange.handle(headers(**{"x-kvplane-tenant": "globex"})) == []
    assert exchange.tenant == "globex"
    # The API key is not the source then: it is neither checked nor removed.
    assert status_of(await Exchange(trusted).handle(headers(**AUTH))) == 401


async def test_a_tenant_past_its_share_of_tokens_in_flight_is_answered_429(state: PickerState) -> None:
    bounded = dataclasses.replace(state, shares=TenantShares(4))
    routed_to(bounded, ROUTE, ROUTE)
    first = Exchange(bounded)
    await first.handle(headers(**AUTH))
    assert not (await first.handle(body(b'{"model": "m", "prompt": [1, 2, 3]}')))[0].HasField(
        "immediate_response"
    )
    second = Exchange(bounded)
    await second.handle(headers(**AUTH))
    assert status_of(await second.handle(body(b'{"model": "m", "prompt": [4, 5]}'))) == 429
    # The first turn's end frees its share.
    first.close()
    third = Exchange(bounded)
    await third.handle(headers(**AUTH))
    assert not (await third.handle(body(b'{"model": "m", "prompt": [4, 5]}')))[0].HasField(
        "immediate_response"
    )


async def test_a_tenant_whose_bodies_are_still_arriving_past_its_share_gets_429_and_others_are_served(
    state: PickerState,
) -> None:
    bounded = dataclasses.replace(state, body_reads=TenantShares(2500, unit="request-body bytes"))
    routed_to(bounded, ROUTE, ROUTE)
    # Two bodies declared at 1000 bytes and one without a length (counted as the 1000-byte limit)
    # would pass acme's 2500: the third is refused on its headers, before Envoy sends its body.
    first, second = Exchange(bounded), Exchange(bounded)
    assert await first.handle(headers(**AUTH, **{"content-length": "1000"})) == []
    assert await second.handle(headers(**AUTH, **{"content-length": "1000"})) == []
    answer = await Exchange(bounded).handle(headers(**AUTH))
    assert status_of(answer) == 429
    assert "request-body bytes" in json.loads(answer[0].immediate_response.body)["error"]["message"]
    # Another tenant's request is read meanwhile.
    assert await Exchange(bounded).handle(headers(authorization="Bearer key-2")) == []
    # A body parsed frees its bytes at once (its turn goes on); a refused one frees them too.
    raw = b'{"model": "m", "prompt": [1, 2, 3]}'
    assert not (await first.handle(body(raw)))[0].HasField("immediate_response")
    assert status_of(await second.handle(body(b"x" * 1001))) == 413
    assert bounded.body_reads.in_flight("acme") == 0
    third = Exchange(bounded)
    assert await third.handle(headers(**AUTH)) == []
    assert bounded.body_reads.in_flight("acme") == 1000
    # A stream that ends before its body does frees them as well.
    third.close()
    assert bounded.body_reads.in_flight("acme") == 0
