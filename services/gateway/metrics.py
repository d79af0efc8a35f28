"""The gateway's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3, 6, 12, 30)
_LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True)
class GatewayMetrics:
    # Turns by the decision they ran under ("pull", "recompute_no_handle", ...,
    # "fallback" without routing, "retry_no_handle" after a failed P leg) and outcome.
    turns: Counter
    ttft: Histogram
    # Latency of each leg: route, prefill, decode, report, end_conversation; by outcome.
    legs: Histogram
    retries: Counter
    requests: Counter
    # Reports held to ride on a Route or a ReportTurns, not sent in a ReportTurn of their own.
    reports_held: Counter
    # Prompt tokens of P legs that answered, by where P got their KV, as P reported it.
    prompt_tokens: Counter
    # Top-level body fields dropped before forwarding (the engines do not accept them); without
    # their names, which are the client's (logged at debug level).
    dropped_fields: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> GatewayMetrics:
        return cls(
            turns=Counter(
                "kvplane_gateway_turns_total",
                "Turns served, by routing decision and outcome",
                ["decision", "outcome"],
                registry=registry,
            ),
            ttft=Histogram(
                "kvplane_gateway_ttft_seconds",
                "Time from the request's arrival to the first token sent to the client, by decision",
                ["decision"],
                registry=registry,
                buckets=_TTFT_BUCKETS,
            ),
            legs=Histogram(
                "kvplane_gateway_leg_seconds",
                "Latency of each leg of a turn (tokenize, route, prefill, decode, report), by outcome",
                ["leg", "outcome"],
                registry=registry,
                buckets=_LEG_BUCKETS,
            ),
            retries=Counter(
                "kvplane_gateway_retries_total",
                "Prefill legs retried without the handle, and routing fallbacks, by reason",
                ["reason"],
                registry=registry,
            ),
            reports_held=Counter(
                "kvplane_gateway_reports_held_total",
                "Turn reports held to ride on the next Route or one ReportTurns, not sent alone",
                registry=registry,
            ),
            requests=Counter(
                "kvplane_gateway_requests_total",
                "HTTP requests by endpoint and status code",
                ["endpoint", "status"],
                registry=registry,
            ),
            prompt_tokens=Counter(
                "kvplane_gateway_prompt_tokens_total",
                "Prompt tokens of answered prefill legs by where the prefill engine got their KV, as it "
                "reported: pulled (read from the holder over NIXL), prefill_cache (its own prefix cache), "
                "computed, or unattributed (cached, by an engine that does not report its pulls)",
                ["source"],
                registry=registry,
            ),
            dropped_fields=Counter(
                "kvplane_gateway_dropped_fields_total",
                "Top-level fields of completion bodies dropped before forwarding: neither the engines "
                "accept them nor gateway.pass_through_fields names them",
                registry=registry,
            ),
        )
