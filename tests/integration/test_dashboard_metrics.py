"""Every metric the chart's Grafana dashboard and alert rules read is one the processes export.

A real stack (etcd, `serve all`, a prefill and a decode sim-engine, the gateway) serves a few turns of
two conversations through the gateway; then every process's /metrics is scraped, and each metric
name in the dashboard's panel queries and in the PrometheusRule's expressions (as the chart renders
them) must be one a process declared. A renamed or removed metric fails here, not on a dashboard.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvplane.bench.live import token_chat
from kvplane.services.devstack.stack import DEMO_API_KEY, Stack, start_stack
from tests.support.deploy_validators import load_deploy_checks

pytest.importorskip("helm_python", reason="the chart is rendered with helm-python-sdk (dev extras)")

# What a family's samples are called besides its name (a counter's family drops `_total`).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}
# Metrics the turns themselves must have given samples to, not only declared.
_OBSERVED = {
    "kvplane_gateway_turns_total",
    "kvplane_gateway_ttft_seconds_bucket",
    "kvplane_gateway_prompt_tokens_total",
    "kvplane_gateway_leg_seconds_count",
    "kvplane_route_seconds_bucket",
    "kvplane_routes_total",
    "kvplane_etcd_request_seconds_bucket",
    "vllm:kv_cache_usage_perc",
}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    running = await start_stack(tmp_path / "run", speedup=50, timeout_s=240)
    try:
        yield running
    finally:
        running.stop()


def _chart_queries() -> dict[str, list[str]]:
    """The queries of the rendered chart's dashboard panels and alert rules, by where they are."""
    checks = load_deploy_checks()
    docs = checks.render_chart({"engines": {"sim": {"enabled": True}}}, "kvp", "kvplane")
    dashboard_cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]
    )
    dashboard = json.loads(dashboard_cm["data"]["kvplane.json"])
    out: dict[str, list[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.setdefault(f"panel {panel['title']!r}", []).append(target["expr"])
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            out.setdefault(f"alert {r['alert']}", []).append(r["expr"])
    return out


def _exported(text: str) -> tuple[set[str], set[str]]:
    """(every metric name the exposition declares, those with samples)."""
    declared: set[str] = set()
    sampled: set[str] = set()
    for family in text_string_to_metric_families(text):
        declared.add(family.name)
        declared.update(family.name + s for s in _SUFFIXES.get(family.type, ()))
        for sample in family.samples:
            declared.add(sample.name)
            sampled.add(sample.name)
    return declared, sampled


async def _serve_turns(stack: Stack) -> list[str]:
    """Three turns of each of two conversations through the gateway; their decisions."""
    decisions = []
    headers = {"Authorization": f"Bearer {DEMO_API_KEY}"}
    async with aiohttp.ClientSession() as session:
        for seed in (1, 2):
            chat = token_chat(
                session,
                f"{stack.gateway_url}/v1/completions",
                {**headers, "X-Conversation-Id": f"dashboard-{seed}"},
                seed=seed,
                turns=3,
                prompt_tokens=300,
                user_tokens=20,
                max_tokens=80,
                model="sim-model",
            )
            decisions += [decision async for decision, _ttft, _ids in chat]
    return decisions


async def _scrape(stack: Stack) -> dict[str, str]:
    urls = {
        "serve all": stack.metrics_url,
        "gateway": f"{stack.gateway_url}/metrics",
        **{f"engine {u}": f"{u}/metrics" for u in stack.prefill_urls + stack.decode_urls},
    }
    out = {}
    async with aiohttp.ClientSession() as session:
        for what, url in urls.items():
            async with session.get(url) as resp:
                assert resp.status == 200, (what, url, resp.status)
                out[what] = await resp.text()
    return out


async def test_every_dashboard_panel_and_alert_reads_metrics_the_processes_export(stack: Stack) -> None:
    checks = load_deploy_checks()
    queries = _chart_queries()
    decisions = await _serve_turns(stack)
    assert len(decisions) == 6 and all(decisions), decisions
    scrapes = await _scrape(stack)
    assert len(scrapes) >= 4, list(scrapes)
    declared: set[str] = set()
    sampled: set[str] = set()
    for text in scrapes.values():
        d, s = _exported(text)
        declared |= d
        sampled |= s
    missing: dict[str, list[str]] = {}
    read: set[str] = set()
    for where, exprs in queries.items():
        for expr in exprs:
            names = checks.metric_names(expr)
            assert names, (where, expr)
            read |= names
            unknown = sorted(names - declared)
            if unknown:
                missing.setdefault(where, []).extend(unknown)
    assert missing == {}, f"metrics no process exports: {missing}"
    # The queries cover every part the dashboard is for, and the turns gave those samples.
    assert read >= _OBSERVED, _OBSERVED - read
    assert sampled >= _OBSERVED, _OBSERVED - sampled
    assert any(q.startswith("alert ") for q in queries) and any(q.startswith("panel ") for q in queries)


def test_an_unexported_metric_in_a_query_would_be_found() -> None:
    """The comparison above is not vacuous: a misspelt name is not among the declared ones."""
    text = "# HELP kvplane_route_seconds x\n# TYPE kvplane_route_seconds histogram\n"
    declared, _ = _exported(text)
    assert "kvplane_route_seconds_bucket" in declared
    names: Any = load_deploy_checks().metric_names("rate(kvplane_route_second_bucket[5m])")
    assert names - declared == {"kvplane_route_second_bucket"}
