"""The gateway's metric names and labels: dashboards and alerts (deploy/) read them by name."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvplane.services.gateway.metrics import GatewayMetrics


def test_the_gateway_exports_its_metrics_under_their_documented_names() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics.create(registry)
    metrics.turns.labels("pull", "ok").inc()
    metrics.ttft.labels("pull").observe(0.3)
    metrics.legs.labels("prefill", "ok").observe(0.01)
    metrics.retries.labels("prefill_failed").inc()
    metrics.requests.labels("/v1/chat/completions", "200").inc()
    metrics.prompt_tokens.labels("pulled").inc(512)

    assert (
        registry.get_sample_value("kvplane_gateway_turns_total", {"decision": "pull", "outcome": "ok"}) == 1
    )
    assert registry.get_sample_value("kvplane_gateway_ttft_seconds_count", {"decision": "pull"}) == 1
    assert (
        registry.get_sample_value("kvplane_gateway_ttft_seconds_bucket", {"decision": "pull", "le": "0.4"})
        == 1
    )
    assert (
        registry.get_sample_value("kvplane_gateway_leg_seconds_count", {"leg": "prefill", "outcome": "ok"})
        == 1
    )
    assert registry.get_sample_value("kvplane_gateway_retries_total", {"reason": "prefill_failed"}) == 1
    assert (
        registry.get_sample_value(
            "kvplane_gateway_requests_total", {"endpoint": "/v1/chat/completions", "status": "200"}
        )
        == 1
    )
    assert registry.get_sample_value("kvplane_gateway_prompt_tokens_total", {"source": "pulled"}) == 512


def test_each_gateway_has_its_own_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics.create(first).turns.labels("pull", "ok").inc()
    GatewayMetrics.create(second)  # the same names again: no clash
    assert first.get_sample_value("kvplane_gateway_turns_total", {"decision": "pull", "outcome": "ok"}) == 1
    assert (
        second.get_sample_value("kvplane_gateway_turns_total", {"decision": "pull", "outcome": "ok"}) is None
    )
