"""The gateway's turn reports: the handle D announced is what the conversation's next turn awaits,
a failed turn forgets it, a report routing cannot take costs the turn nothing but a metric, and
each finished turn is one debug line."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvplane.services.client import RouteResult, RoutingClient
from kvplane.services.client.routing_client import report_request
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.gateway.identity import Identity
from kvplane.services.gateway.metrics import GatewayMetrics
from kvplane.services.gateway.progress import PromptSources, TurnProgress, TurnRequest
from kvplane.services.gateway.reports import TurnReporter
from kvplane.services.gateway.settings import GatewaySection
from kvplane.v1 import routing_pb2
from tests.support.gateway_parts import route as route_to


def _turn(conversation: str = "c1", tenant: str = "acme") -> TurnRequest:
    return TurnRequest(
        Identity(tenant, conversation, "header"), {}, True, True, "m", False, time.perf_counter()
    )


def _reporter() -> tuple[TurnReporter, RoutingClient, CollectorRegistry]:
    registry = CollectorRegistry()
    # Nothing listens there: every report fails.
    routing = RoutingClient([f"127.0.0.1:{free_port()}"], timeout_s=0.5, attempts=1)
    settings = GatewaySection(report_timeout_s=0.5)
    return TurnReporter(settings, routing, GatewayMetrics.create(registry)), routing, registry


async def test_the_next_turn_awaits_the_handle_the_last_one_announced() -> None:
    reporter, routing, _ = _reporter()
    try:
        assert reporter.awaited(_turn()) == ("", 0)
        reporter.announce(_turn(), {"kvplane_handle_id": "h1", "remote_num_tokens": 320})
        assert reporter.awaited(_turn()) == ("h1", 320)
        assert reporter.awaited(_turn(tenant="globex")) == ("", 0), "per tenant and conversation"
        reporter.announce(_turn(), {"remote_num_tokens": 5})  # no handle named: nothing changes
        reporter.announce(_turn(), {"kvplane_handle_id": "h2", "remote_num_tokens": True})
        assert reporter.awaited(_turn()) == ("h2", 0), "a count that is no count is unknown"
    finally:
        await routing.close()


async def test_a_failed_turn_forgets_its_announcement_and_a_lost_report_is_counted() -> None:
    reporter, routing, registry = _reporter()
    try:
        reporter.announce(_turn(), {"kvplane_handle_id": "h1", "remote_num_tokens": 32})
        route = RouteResult.from_pb(routing_pb2.RouteResponse())
        reporter.report_later(_turn(), route, TurnProgress("recompute_no_handle"), success=False)
        assert reporter.awaited(_turn()) == ("", 0), "a failed turn's blocks may not exist"
        await reporter.drain(30)
        assert (
            registry.get_sample_value(
                "kvplane_gateway_leg_seconds_count", {"leg": "report", "outcome": "error"}
            )
            == 1
        )
    finally:
        await routing.close()


def _routed(replica: int = 0) -> RouteResult:
    return RouteResult.from_pb(routing_pb2.RouteResponse(route_id="r1"), replica)


def _held(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("kvplane_gateway_reports_held_total") or 0.0


async def test_a_routed_turn_whose_engine_publishes_its_handle_is_held_for_the_next_route() -> None:
    reporter, routing, registry = _reporter()
    try:
        progress = TurnProgress("pull")
        progress.decode_params = {"kvplane_handle_id": "h1", "remote_num_tokens": 32}
        reporter.report_later(_turn(), _routed(), progress, success=True)
        assert _held(registry) == 1 and not reporter._reports, "no ReportTurn call of its own"
        # D kept nothing (or said nothing): only learning, held as well.
        reporter.report_later(_turn("c2"), _routed(), TurnProgress("recompute_cost"), success=True)
        assert _held(registry) == 2
    finally:
        await routing.close()


async def test_reports_that_act_at_once_are_sent_at_once() -> None:
    reporter, routing, registry = _reporter()
    try:
        # D without kvplane's connector: the report is its handle's only source.
        progress = TurnProgress("pull")
        progress.decode_params = {"remote_block_ids": [[1]], "remote_num_tokens": 16}
        reporter.report_later(_turn(), _routed(), progress, success=True)
        # A fallback turn was not routed; an ephemeral conversation is ended right after.
        reporter.report_later(
            _turn("c2"),
            RouteResult.from_pb(routing_pb2.RouteResponse()),
            TurnProgress("fallback"),
            success=True,
        )
        ephemeral = TurnRequest(
            Identity("acme", "e1", "ephemeral"), {}, True, True, "m", False, time.perf_counter()
        )
        reporter.report_later(ephemeral, _routed(), TurnProgress("recompute_no_handle"), success=True)
        assert _held(registry) == 0 and len(reporter._reports) == 3
        await reporter.drain(30)
    finally:
        await routing.close()


async def test_each_finished_turn_is_one_debug_line_saying_where_it_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reporter, routing, _ = _reporter()
    try:
        route = route_to("http://p", "http://d", decision="recompute_cost", prefill_id="p1", decode_id="d0")
        progress = TurnProgress("recompute_cost", [1] * 96)
        progress.sources = PromptSources(prompt=96, pulled=0, prefill_cache=64, computed=32)
        progress.ttft_s = 0.25
        with caplog.at_level(logging.INFO, logger="kvplane.services.gateway.reports"):
            reporter.finish(_turn(), route, progress, success=True)
        assert not [r for r in caplog.records if r.getMessage() == "turn"], "off unless debugging"
        with caplog.at_level(logging.DEBUG, logger="kvplane.services.gateway.reports"):
            reporter.finish(_turn("c2"), route, progress, success=False, error="decode stream failed")
        (line,) = [r for r in caplog.records if r.getMessage() == "turn"]
        said = {key: getattr(line, key) for key in ("conversation", "decision", "outcome", "prefill_node")}
        assert said == {
            "conversation": "c2",
            "decision": "recompute_cost",
            "outcome": "failed",
            "prefill_node": "p1",
        }
        assert (line.decode_node, line.prompt_tokens, line.cached_tokens, line.computed_tokens) == (
            "d0",
            96,
            64,
            32,
        )
        assert (line.ttft_ms, line.error) == (250.0, "decode stream failed")
    finally:
        await routing.close()


def test_the_report_carries_how_long_p_said_its_pull_took() -> None:
    progress = TurnProgress("pull", [1] * 96)
    progress.sources = PromptSources(prompt=96, pulled=64, prefill_cache=0, computed=32, pull_ms=23.5)
    assert TurnReporter._fields(_turn(), progress, True, None)["transfer_ms"] == 23.5
    # P did not say: routing estimates the pull itself.
    progress.sources = PromptSources(prompt=96, pulled=64, prefill_cache=0, computed=32)
    assert TurnReporter._fields(_turn(), progress, True, None)["transfer_ms"] == 0.0


def test_the_report_carries_how_long_p_said_the_prompt_waited() -> None:
    progress = TurnProgress("pull", [1] * 96)
    progress.sources = PromptSources(prompt=96, pulled=64, prefill_cache=0, computed=32, queued_ms=412.5)
    request = report_request(None, "c1", **TurnReporter._fields(_turn(), progress, True, None))
    assert request.HasField("prefill_queued_ms") and request.prefill_queued_ms == 412.5
    # P did not say: the field is unset, and routing takes its own estimate of the wait off.
    progress.sources = PromptSources(prompt=96, pulled=64, prefill_cache=0, computed=32)
    assert not report_request(None, "c1", **TurnReporter._fields(_turn(), progress, True, None)).HasField(
        "prefill_queued_ms"
    )
