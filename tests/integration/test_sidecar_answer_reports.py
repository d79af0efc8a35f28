"""The sidecar reports D's answer to the picker's answer endpoint (`sidecar/answer_report.py`),
against a stand-in decode engine and a stand-in endpoint on loopback: the report comes before the
client sees the answer end, and a stream that breaks is reported unfinished."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import aiohttp
import orjson
import pytest
from aiohttp import web
from pydantic import SecretStr

from kvplane.services.client import Endpoint, RouteResult
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.epp.answers import PendingAnswers, answers_app
from kvplane.services.gateway import legs
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.sidecar.answer_report import AnswerReport
from kvplane.services.sidecar.app import Sidecar
from kvplane.services.sidecar.settings import SidecarSection
from kvplane.services.sidecar.signed_route import ROUTE_HEADER, sign
from kvplane.v1 import routing_pb2
from tests.support.polling import eventually

KEY = "route-key-0123456789abcdef"
EVENTS = [
    {"choices": [{"text": "a"}]},
    {"choices": [{"text": "b"}]},
    {"choices": [{"text": "c", "finish_reason": "length"}], "kv_transfer_params": {"kvplane_handle_id": "h"}},
]


@dataclass
class FakeDecode:
    # Break the stream (close the connection) after this many events; None: end it with [DONE].
    break_after: int | None = None
    # When set, the body ends (after `data: [DONE]`) only once the test opens this gate, in a
    # write of its own, as uvicorn under vLLM ends a response; each end closes it again.
    end_gate: asyncio.Event | None = None
    # The client port of every request: how many connections they came on.
    client_ports: list[int] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        self.client_ports.append(request.transport.get_extra_info("peername")[1])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, event in enumerate(EVENTS):
            if self.break_after is not None and i == self.break_after:
                assert request.transport is not None
                request.transport.close()
                return response
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        if self.end_gate is not None:
            await self.end_gate.wait()
            self.end_gate.clear()
        await response.write_eof()
        return response


@dataclass
class Recorder:
    """A turn awaiting its report, as the picker's: what came, and what the client had seen then."""

    client_seen: list[bytes]
    reports: list[tuple[AnswerReport, bytes]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def take_report(self, report: AnswerReport) -> None:
        self.reports.append((report, b"".join(self.client_seen)))

    def finish(self, error: str = "") -> None:
        self.finished.append(error)


@dataclass
class Bench:
    session: aiohttp.ClientSession
    decode: FakeDecode
    pending: PendingAnswers
    answers_url: str
    sidecar: Sidecar


async def _dispatch(decode: FakeDecode, request: web.Request) -> web.StreamResponse:
    """D's handler as the test sets it now (a test may swap it)."""
    return await decode.handle(request)


@pytest.fixture
async def bench() -> AsyncIterator[Bench]:
    decode = FakeDecode()
    runners = []
    pending = PendingAnswers(60.0)
    ports = []
    for app in (web.Application(), answers_app(pending, KEY.encode())):
        if not ports:
            app.router.add_post("/v1/completions", partial(_dispatch, decode))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        ports.append(port)
    side = SidecarSection(
        listen=f"127.0.0.1:{free_port()}",
        decode_url=f"http://127.0.0.1:{ports[0]}",
        route_key=SecretStr(KEY),
    )
    sidecar = Sidecar(side, GatewaySection(), Telemetry.disabled())
    await sidecar.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Bench(session, decode, pending, f"http://127.0.0.1:{ports[1]}", sidecar)
    finally:
        await sidecar.stop()
        for runner in runners:
            await runner.cleanup()


def route(decode_url: str) -> RouteResult:
    return RouteResult(
        route_id="r-1",
        decision="recompute_no_handle",
        reason="",
        prefill=Endpoint("p", "http://127.0.0.1:1", "i"),
        decode=Endpoint("d", decode_url, "i"),
        prefill_params={},
        expected_reused_tokens=0,
        response=routing_pb2.RouteResponse(),
    )


async def stream_turn(b: Bench, answer_id: str, seen: list[bytes]) -> None:
    """A streamed turn through the sidecar with a route that names the answer endpoint; what the
    client reads goes into `seen` as it arrives."""
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "stream": True, "max_tokens": 3}).encode()
    token = sign(
        KEY.encode(),
        route(b.sidecar.settings.decode_url),
        body=body,
        return_token_ids=False,
        expires_at=time.time() + 30,
        answer_to=b.answers_url,
        answer_id=answer_id,
    )
    headers = {ROUTE_HEADER: token, "Content-Type": "application/json"}
    url = f"http://{b.sidecar.address}/v1/completions"
    async with b.session.post(url, data=body, headers=headers) as resp:
        assert resp.status == 200
        async for chunk in resp.content.iter_any():
            seen.append(chunk)


async def test_the_report_comes_before_the_client_sees_the_answer_end(bench: Bench) -> None:
    seen: list[bytes] = []
    turn = Recorder(seen)
    bench.pending.expect("a-1", turn)
    await stream_turn(bench, "a-1", seen)
    [(report, client_had)] = turn.reports
    assert report.finished and report.decode_params == {"kvplane_handle_id": "h"}
    assert report.ttft_s is not None and report.ttft_s > 0
    # When the picker took the report, the client had the first tokens and not the end.
    assert b'"text":"a"' in client_had.replace(b" ", b"") and b"[DONE]" not in client_had
    whole = b"".join(seen)
    assert whole.endswith(b"data: [DONE]\n\n") and b"kv_transfer_params" not in whole
    assert whole.count(b"data: ") == 4


async def test_a_stream_that_breaks_is_reported_unfinished(bench: Bench) -> None:
    bench.decode.break_after = 1
    seen: list[bytes] = []
    turn = Recorder(seen)
    bench.pending.expect("a-2", turn)
    await stream_turn(bench, "a-2", seen)
    # The client reads the first token, then an error event, as the gateway ends such a stream.
    events = [line for line in b"".join(seen).split(b"\n\n") if line]
    assert json.loads(events[0][6:]) == EVENTS[0]
    assert json.loads(events[1][6:])["error"]["code"] == 502 and events[-1] == b"data: [DONE]"

    async def reported() -> list[tuple[AnswerReport, bytes]]:
        return turn.reports

    [(report, _)] = await eventually(reported, timeout_s=30, what="the sidecar's report of a broken stream")
    assert not report.finished and "decode stream failed" in report.error


async def test_a_client_that_leaves_is_reported_unfinished(bench: Bench) -> None:
    # D never ends its stream: the client reads the first token and leaves.
    gate = asyncio.Event()
    original = bench.decode.handle

    async def stalls(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + orjson.dumps(EVENTS[0]) + b"\n\n")
        await gate.wait()
        return response

    bench.decode.handle = stalls  # type: ignore[method-assign]
    seen: list[bytes] = []
    turn = Recorder(seen)
    bench.pending.expect("a-3", turn)
    task = asyncio.create_task(stream_turn(bench, "a-3", seen))

    async def first_token() -> bool:
        return bool(seen)

    await eventually(first_token, timeout_s=30, what="the first token")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def reported() -> list[tuple[AnswerReport, bytes]]:
        return turn.reports

    try:
        [(report, _)] = await eventually(reported, timeout_s=30, what="the report of a turn the client left")
    finally:
        gate.set()
        bench.decode.handle = original  # type: ignore[method-assign]
    assert not report.finished and report.error == "the client disconnected"
    assert report.ttft_s is not None


async def test_ds_connection_serves_the_next_turn_when_its_body_ends_late(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D's `data: [DONE]` and the end of its body may come in two reads: the sidecar reads to the
    end before it hands the connection back, so the next turn reuses it."""
    # D ends each body only after the client has its whole answer; the sidecar waits as long as
    # this test may take to let it (a loaded machine included).
    monkeypatch.setattr(legs, "BODY_END_WAIT_S", 60.0)
    gate = bench.decode.end_gate = asyncio.Event()
    histogram = bench.sidecar.metrics.legs

    def decode_legs_ended() -> float:
        return sum(
            s.value
            for m in histogram.collect()
            for s in m.samples
            if s.name.endswith("_count") and s.labels.get("leg") == "decode"
        )

    for i in range(1, 4):
        seen: list[bytes] = []
        turn = Recorder(seen)
        bench.pending.expect(f"c-{i}", turn)
        await stream_turn(bench, f"c-{i}", seen)
        assert b"".join(seen).endswith(b"data: [DONE]\n\n")
        gate.set()

        async def ended(i: int = i) -> bool:
            return decode_legs_ended() == i

        # The next turn's D leg comes once this one has ended.
        await eventually(ended, timeout_s=30, what=f"the sidecar's D leg {i} to end")
    ports = bench.decode.client_ports
    assert len(ports) == 3 and len(set(ports)) == 1, ports
