"""The pieces a gateway turn is made of, built apart for tests of one step: a scripted routing
client, a turn request, and the settings, metrics and reporter the steps share."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from kvplane.services.client import Endpoint, RouteResult
from kvplane.services.gateway.fallback import FallbackEngines
from kvplane.services.gateway.identity import Identity
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import TurnRequest
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.suspects import SuspectEngines
from kvplane.v1 import routing_pb2
from tests.support.polling import until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
P_ROUTE_PARAMS = {"do_remote_decode": True, "kvplane_tenant": "acme", "kvplane_conversation": "c1"}


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def route(
    prefill_url: str,
    decode_url: str,
    *,
    route_id: str = "r1",
    decision: str = "pull",
    prefill_id: str = "p0",
    decode_id: str = "d0",
) -> RouteResult:
    return RouteResult(
        route_id=route_id,
        decision=decision,
        reason="scripted",
        prefill=Endpoint(prefill_id, prefill_url, f"{prefill_id}-life"),
        decode=Endpoint(decode_id, decode_url, f"{decode_id}-life"),
        prefill_params=dict(P_ROUTE_PARAMS),
        expected_reused_tokens=0,
        response=routing_pb2.RouteResponse(),
    )


def turn(
    *, stream: bool = False, body: dict[str, Any] | None = None, chat: bool = True, source: str = "header"
) -> TurnRequest:
    return TurnRequest(
        identity=Identity("acme", "c1", source),
        # The client's body: a streamed turn's says so, as the client sent it.
        body={**(body or CHAT), **({"stream": True} if stream else {})},
        chat=chat,
        stream=stream,
        model=str((body or CHAT).get("model", "m")),
        client_token_ids=False,
        arrival=time.perf_counter(),
    )


@dataclass
class ScriptedRouting:
    """Answers Route with the next of `routes` (a RouteResult, or an exception to raise) and records
    every call; ReportTurn and EndConversation are recorded and answered at once, and a held
    report is recorded as a ReportTurn's arguments would be (with `held`)."""

    routes: list[RouteResult | Exception] = field(default_factory=list)
    asked: list[dict[str, Any]] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)

    async def route(self, conversation: str, model: str, **kw: Any) -> RouteResult:
        self.asked.append({"conversation": conversation, "model": model, **kw})
        answer = self.routes.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def report_turn(self, route: RouteResult | None, conversation: str, **kw: Any) -> str:
        self.reports.append({"route": route, "conversation": conversation, **kw})
        return ""

    def hold_report(self, route: RouteResult, report: routing_pb2.ReportTurnRequest) -> None:
        self.reports.append(
            {"route": route, "conversation": report.conversation, "held": True, **_said(report)}
        )

    async def send_held_reports(self, timeout_s: float | None = None) -> int:
        return 0

    async def end_conversation(self, conversation: str, **kw: Any) -> int:
        self.ended.append(conversation)
        return 0


def _said(report: routing_pb2.ReportTurnRequest) -> dict[str, Any]:
    """A report's fields under `RoutingClient.report_turn`'s argument names."""
    decode, prefill = report.decode_kv_transfer_params_json, report.prefill_kv_transfer_params_json
    return {
        "success": report.success,
        "decode_kv_transfer_params": json.loads(decode) if decode else None,
        "prefill_kv_transfer_params": json.loads(prefill) if prefill else None,
        "ttft_ms": report.ttft_ms,
        "prompt_tokens": report.prompt_tokens,
        "pulled_tokens": report.pulled_tokens,
        "cached_tokens": report.cached_tokens if report.HasField("cached_tokens") else None,
        "prefill_ms": report.prefill_ms,
        "retained_token_ids": list(report.retained_token_ids),
        "error": report.error,
        "model": report.model,
        "tenant": report.tenant,
        "ended_unix_ms": report.ended_unix_ms if report.HasField("ended_unix_ms") else None,
    }


@dataclass
class Parts:
    settings: GatewaySection
    routing: ScriptedRouting
    metrics: GatewayMetrics
    reporter: TurnReporter
    tracer: trace.Tracer
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def leg_count(self, leg: str, outcome: str) -> float:
        return self.metric("kvplane_gateway_leg_seconds_count", leg=leg, outcome=outcome)


def parts(**settings: Any) -> Parts:
    section = GatewaySection(**({"prefill_timeout_s": 5.0, "decode_timeout_s": 10.0} | settings))
    routing = ScriptedRouting()
    registry = CollectorRegistry()
    metrics = GatewayMetrics.create(registry)
    reporter = TurnReporter(section, routing, metrics)  # type: ignore[arg-type]
    return Parts(section, routing, metrics, reporter, trace.get_tracer("test"), registry)


def fallback_engines(p: Parts) -> FallbackEngines:
    s = p.settings
    return FallbackEngines(
        s.fallback_prefill_url, s.fallback_decode_url, SuspectEngines(s.fallback_suspect_s)
    )


async def reported(p: Parts, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Waits for `count` ReportTurn calls (reports run as tasks, off the client's path)."""
    await until(lambda: len(p.routing.reports) >= count, f"{count} report(s)", timeout_s=timeout_s)
    return p.routing.reports
