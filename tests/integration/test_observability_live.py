"""A live stack as its operators see it: one trace per turn across every process, and token metrics
that agree with what the engines did.

Real etcd, metadata and routing over gRPC, two sim-engine processes with real NIXL, the gateway; spans
go over OTLP/gRPC to a receiver the test runs, configured only by OpenTelemetry's own variables.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from kvplane.services.common.runtime.sampling import BACKGROUND_METHODS
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.gateway_stack import MODEL, GatewayStack, TurnResult, gateway_stack
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, receiver_as_collector
from tests.support.polling import eventually


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    # What an operator sets; the engines inherit it.
    with receiver_as_collector(monkeypatch) as server:
        yield server


@pytest.fixture
async def traced_stack(
    etcd: LocalEtcd, tmp_path: pytest.TempPathFactory, receiver: OtlpReceiver
) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(etcd, f"/kvplane-obs/{uuid.uuid4().hex}/", tmp_path, traced=True) as s:  # type: ignore[arg-type]
        yield s


@pytest.fixture
async def stack(etcd: LocalEtcd, tmp_path: pytest.TempPathFactory) -> AsyncIterator[GatewayStack]:
    async with gateway_stack(etcd, f"/kvplane-obs/{uuid.uuid4().hex}/", tmp_path) as s:  # type: ignore[arg-type]
        yield s


def _ids(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(300, 30_000) for _ in range(n)]


async def _conversation(stack: GatewayStack, turns: int, seed: int) -> list[TurnResult]:
    """`turns` completions of one conversation, each continuing the last answer."""
    conv = f"conv-{uuid.uuid4().hex[:12]}"
    prompt = _ids(400, seed)
    handle = ""
    results = []
    for turn in range(turns):
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 80,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        result = await stack.post("/v1/completions", body, stack.headers("acme", conv))
        assert result.status == 200, result.raw
        results.append(result)
        handle = await stack.wait_handle("acme", conv, other_than=handle)
        prompt = prompt + result.output_ids() + _ids(40, seed * 100 + turn)
    return results


def _trace_of_pulled_turn(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    turns = [s for s in spans if s.name == "gateway.turn" and s.attributes.get("kvplane.decision") == "pull"]
    if not turns:
        return []
    return [s for s in spans if s.trace_id == turns[0].trace_id]


async def test_a_pulled_turn_is_one_trace_from_the_gateway_through_routing_etcd_and_both_engines(
    traced_stack: GatewayStack, receiver: OtlpReceiver
) -> None:
    results = await _conversation(traced_stack, turns=2, seed=3)
    assert [r.decision for r in results] == ["recompute_no_handle", "pull"]

    def complete() -> list[ReceivedSpan]:
        trace = _trace_of_pulled_turn(receiver.spans())
        names = {(s.service, s.name) for s in trace}
        wanted = {
            ("kvplane-gateway", "gateway.turn"),
            ("kvplane-routing", "/kvplane.v1.RoutingService/Route"),
            ("kvplane-sim-engine", "kv.pull"),
            ("kvplane-metadata", "/kvplane.v1.MetadataService/PublishHandles"),
        }
        if not wanted <= names:
            return []
        # Each process exports a span once it ends, in batches: a parent (an engine's request) may
        # arrive after its children. Wait for the whole tree; a span whose parent never comes is
        # a broken trace, and the wait then fails.
        by_id = {s.span_id for s in trace}
        return trace if len([s for s in trace if s.parent_span_id not in by_id]) == 1 else []

    async def probe() -> list[ReceivedSpan]:
        return complete()

    trace = await eventually(probe, timeout_s=30, what="the pulled turn's trace in every process, one tree")
    by_id = {s.span_id: s for s in trace}
    # One tree: every span but the turn's has its parent in the same trace.
    (root,) = [s for s in trace if s.parent_span_id not in by_id]
    assert root.name == "gateway.turn" and root.service == "kvplane-gateway"

    # Routing checked the handle out in etcd, inside its Route span; its other etcd calls (ReportTurn's)
    # are inside its other server spans of the same trace.
    route = next(s for s in trace if s.name == "/kvplane.v1.RoutingService/Route")
    etcd_calls = [
        s for s in trace if s.service == "kvplane-routing" and s.attributes.get("db.system") == "etcd"
    ]
    assert any(s.name == "etcd.check_out" and _descends(s, route, by_id) for s in etcd_calls)
    assert all(by_id[s.parent_span_id].name.startswith("/kvplane.v1.RoutingService/") for s in etcd_calls)

    # Both engines served their leg inside the trace, each under the gateway's leg span.
    engine_spans = {
        s.attributes["kvplane.engine.role"]: s
        for s in trace
        if s.service == "kvplane-sim-engine" and s.name == "POST /v1/completions"
    }
    assert set(engine_spans) == {"prefill", "decode"}
    assert by_id[engine_spans["prefill"].parent_span_id].name == "gateway.prefill"
    assert by_id[engine_spans["decode"].parent_span_id].name == "gateway.decode"
    pull = next(s for s in trace if s.name == "kv.pull" and s.attributes["kvplane.leg"] == "prefill")
    assert pull.parent_span_id == engine_spans["prefill"].span_id
    # The pull's time, split: the NIXL READ, then checking every block it read.
    pull_ms = (pull.end_time - pull.start_time) / 1e6
    read_ms, verify_ms = pull.attributes["kvplane.pull.read_ms"], pull.attributes["kvplane.pull.verify_ms"]
    assert read_ms > 0 and verify_ms > 0 and read_ms + verify_ms <= pull_ms

    # D's handle publish is part of the turn's trace, under D's request.
    publish = next(s for s in trace if s.name == "/kvplane.v1.MetadataService/PublishHandles")
    assert _descends(publish, engine_spans["decode"], by_id)

    # The turn's span says what happened to its prompt, and when the first token came.
    attrs = root.attributes
    assert attrs["kvplane.decision"] == "pull"
    assert attrs["kvplane.tokens.pulled"] > 0
    assert attrs["kvplane.tokens.pulled"] == engine_spans["prefill"].attributes["kvplane.tokens.pulled"]
    assert (
        attrs["kvplane.tokens.prefill_cache"]
        == engine_spans["prefill"].attributes["kvplane.tokens.prefill_cache"]
    )
    assert attrs["kvplane.tokens.computed"] == engine_spans["prefill"].attributes["kvplane.tokens.computed"]
    parts = (
        attrs["kvplane.tokens.pulled"]
        + attrs["kvplane.tokens.prefill_cache"]
        + attrs["kvplane.tokens.computed"]
    )
    assert parts == attrs["kvplane.tokens.prompt"] == results[1].body["usage"]["prompt_tokens"]
    assert attrs["kvplane.ttft_s"] > 0


async def test_heartbeats_and_load_reports_start_no_traces_at_default_settings(
    traced_stack: GatewayStack, receiver: OtlpReceiver
) -> None:
    # The engines report load every 0.2 s and renew their leases meanwhile; a turn marks the end.
    await _conversation(traced_stack, turns=1, seed=5)

    async def turn_exported() -> bool:
        return any(s.name == "gateway.turn" for s in receiver.spans())

    await eventually(turn_exported, timeout_s=30, what="the turn's spans")
    spans = receiver.spans()
    roots = [s for s in spans if not s.parent_span_id]
    assert not [s.name for s in roots if s.name in BACKGROUND_METHODS]
    assert not [s.name for s in roots if s.attributes.get("db.system") == "etcd"]
    services = {s.service for s in spans}
    assert {"kvplane-gateway", "kvplane-routing", "kvplane-sim-engine", "kvplane-metadata"} <= services


async def test_the_gateways_pulled_tokens_equal_the_prefill_engines_nixl_counter(stack: GatewayStack) -> None:
    for seed in (7, 8):
        results = await _conversation(stack, turns=3, seed=seed)
        assert [r.decision for r in results] == ["recompute_no_handle", "pull", "pull"]

    async def engine(source: str) -> float:
        return await stack.prefill.metric(stack.session, "vllm:prompt_tokens_by_source_total", source=source)

    async def gateway(source: str) -> float:
        return await stack.gateway_metric("kvplane_gateway_prompt_tokens_total", source=source)

    pulled = await engine("external_kv_transfer")
    assert pulled > 0
    assert await gateway("pulled") == pulled
    # P's own prefix cache and what it computed are counted apart, and also agree with P.
    assert await engine("local_cache_hit") > 0
    assert await gateway("prefill_cache") == await engine("local_cache_hit")
    assert await gateway("computed") == await engine("local_compute")
    assert await gateway("unattributed") == 0


def _descends(span: ReceivedSpan, ancestor: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> bool:
    parent = by_id.get(span.parent_span_id)
    while parent is not None:
        if parent.span_id == ancestor.span_id:
            return True
        parent = by_id.get(parent.parent_span_id)
    return False
