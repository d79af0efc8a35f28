"""The services' probes: readiness follows etcd, liveness and startup only the process."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.deploy_validators import load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="helm_python not installed: pip install -e '.[dev]'",
)


@pytest.mark.parametrize("tls", [False, True])
def test_liveness_asks_the_health_service_an_etcd_outage_leaves_serving(tls: bool) -> None:
    values = (
        {"gateway": {"enabled": False}, "grpc": {"tls": {"enabled": True, "serverSecret": "srv"}}}
        if tls
        else {}
    )
    docs = load_deploy_checks().render_chart(values, "kvp", "llm")
    services = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and d["metadata"]["name"].rsplit("-", 1)[-1] in {"metadata", "routing", "eviction"}
    ]
    assert len(services) == 3
    for deployment in services:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        for probe in ("livenessProbe", "startupProbe"):
            spec = container[probe]
            asks = (
                spec["grpc"].get("service")
                if "grpc" in spec
                else next(a.split("=", 1)[1] for a in spec["exec"]["command"] if a.startswith("--service="))
            )
            assert asks == "liveness", (deployment["metadata"]["name"], probe)
        ready = container["readinessProbe"]
        assert (
            ready["grpc"].get("service", "") == ""
            if "grpc" in ready
            else not any(a.startswith("--service=") for a in ready["exec"]["command"])
        )
