"""The sim-engine's request spans: each API request of a turn is a SERVER span inside the caller's
trace; health checks, scrapes and the /sim/* routes start none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.connector.simengine.tracing import TRACED_PATHS, tracing_middleware
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


async def _answer(request: web.Request) -> web.Response:
    status = int(request.query.get("status", "200"))
    return web.json_response({"path": request.path}, status=status)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, Telemetry, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-sim-engine", exporter=exporter)
    app = web.Application(middlewares=[tracing_middleware(telemetry.tracer, "decode")])
    for path in (*TRACED_PATHS, "/sim/state", "/metrics"):
        app.router.add_route("*", path, _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", telemetry, exporter
    finally:
        await runner.cleanup()
        telemetry.shutdown()


def _spans(telemetry: Telemetry, exporter: InMemorySpanExporter) -> list[Any]:
    telemetry.tracer_provider.force_flush()
    return list(exporter.get_finished_spans())


async def test_a_turns_request_is_a_server_span_in_the_callers_trace(
    engine: tuple[str, Telemetry, InMemorySpanExporter],
) -> None:
    url, telemetry, exporter = engine
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json={}, headers=headers) as resp,
    ):
        assert resp.status == 200
    [span] = _spans(telemetry, exporter)
    assert span.name == "POST /v1/completions" and span.kind is trace.SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == PARENT
    assert (
        span.attributes["kvplane.engine.role"] == "decode"
        and span.attributes["url.path"] == "/v1/completions"
    )
    assert span.attributes["http.response.status_code"] == 200 and span.status.is_ok


async def test_a_request_without_a_caller_starts_its_own_trace(
    engine: tuple[str, Telemetry, InMemorySpanExporter],
) -> None:
    url, telemetry, exporter = engine
    async with aiohttp.ClientSession() as s, s.post(url + "/tokenize", json={}) as resp:
        assert resp.status == 200
    [span] = _spans(telemetry, exporter)
    assert span.parent is None and span.name == "POST /tokenize"


async def test_a_server_error_marks_the_span_failed_and_a_client_error_does_not(
    engine: tuple[str, Telemetry, InMemorySpanExporter],
) -> None:
    url, telemetry, exporter = engine
    async with aiohttp.ClientSession() as s:
        for status in (503, 400):
            async with s.post(url + f"/v1/chat/completions?status={status}", json={}) as resp:
                assert resp.status == status
    failed, refused = _spans(telemetry, exporter)
    assert failed.attributes["http.response.status_code"] == 503
    assert failed.status.status_code is trace.StatusCode.ERROR
    assert refused.attributes["http.response.status_code"] == 400
    assert refused.status.status_code is trace.StatusCode.UNSET


async def test_scrapes_and_tooling_routes_start_no_trace(
    engine: tuple[str, Telemetry, InMemorySpanExporter],
) -> None:
    url, telemetry, exporter = engine
    async with aiohttp.ClientSession() as s:
        for path in ("/metrics", "/sim/state"):
            async with s.get(url + path) as resp:
                assert resp.status == 200 and (await resp.json())["path"] == path
    assert _spans(telemetry, exporter) == []
