"""OpenTelemetry's two variables alone, `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_SERVICE_NAME`, make a
kvplane process export its spans, under that name, in its caller's trace."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.otlp_receiver import OtlpReceiver
from tests.support.simengine import MODEL, start_engine, stop_engine, wait_for, wait_healthy

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    server = OtlpReceiver()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_the_otlp_endpoint_and_service_name_variables_alone_configure_export(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in (
        "OTEL_TRACES_SAMPLER",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "engine-eu-7")
    engine = start_engine("traced", tmp_path)
    try:
        wait_healthy(engine)
        request = urllib.request.Request(
            engine.url + "/v1/completions",
            data=json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200
        # The batch processor exports within its default 5 s delay.
        spans = wait_for(
            lambda: [s for s in receiver.spans() if s.name == "POST /v1/completions"], 30, "the exported span"
        )
    finally:
        stop_engine(engine)
    (span,) = spans
    assert span.service == "engine-eu-7"
    assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
