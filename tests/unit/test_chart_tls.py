"""The Helm chart's gRPC TLS: certificates from Secrets for every process, mTLS principals, probes
that speak TLS, and only the services holding the token list."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.deploy_validators import is_kvplane_workload, load_deploy_checks

ROOT = Path(__file__).resolve().parents[2]
CHART_CI = ROOT / "deploy" / "helm" / "kvplane" / "ci"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="deploy validators not installed: pip install -e '.[dev]'",
)

SERVICES = ("metadata", "routing", "eviction")


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


def _render(checks: ModuleType, values_file: str) -> dict[str, dict[str, Any]]:
    values = yaml.safe_load((CHART_CI / values_file).read_text())
    docs = checks.render_chart(values, "kvp", "kvplane")
    return {d["metadata"]["name"]: d for d in docs if is_kvplane_workload(d)}


def _pod(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _tls_secret(pod: dict[str, Any]) -> str | None:
    for volume in pod["volumes"]:
        if volume["name"] == "grpc-tls":
            return str(volume["secret"]["secretName"])
    return None


def test_mtls_values_give_every_process_its_certificate_from_its_own_secret(checks: ModuleType) -> None:
    deployments = _render(checks, "mtls-values.yaml")
    for service in SERVICES:
        pod, c = _pod(deployments[f"kvp-kvplane-{service}"])
        env = _env(c)
        assert env["KVPLANE_AUTH__MODE"] == "mtls"
        assert env["KVPLANE_GRPC__TLS__CERT_FILE"] == "/etc/kvplane-tls/tls.crt"
        assert env["KVPLANE_GRPC__TLS__KEY_FILE"] == "/etc/kvplane-tls/tls.key"
        assert env["KVPLANE_GRPC__TLS__CLIENT_CA_FILE"] == "/etc/kvplane-tls/ca.crt"
        assert _tls_secret(pod) == "kvplane-grpc-server-tls"
        # Certificates name the principals: no token list anywhere.
        assert "KVPLANE_AUTH__TOKENS" not in env
    clients = {
        "kvp-kvplane-gateway": ("KVPLANE_GATEWAY__ROUTING_TLS_", "kvplane-gateway-tls"),
        "kvp-kvplane-sim-prefill": ("KVPLANE_SIM_TLS_", "kvplane-sim-prefill-tls"),
        "kvp-kvplane-sim-decode": ("KVPLANE_SIM_TLS_", "kvplane-sim-decode-tls"),
        "kvp-kvplane-vllm-prefill": ("KVPLANE_TLS_", "kvplane-vllm-prefill-tls"),
        "kvp-kvplane-vllm-decode": ("KVPLANE_TLS_", "kvplane-vllm-decode-tls"),
    }
    for name, (prefix, secret) in clients.items():
        pod, c = _pod(deployments[name])
        env = _env(c)
        assert env[prefix + "CA_FILE"] == "/etc/kvplane-tls/ca.crt", name
        assert env[prefix + "CERT_FILE"] == "/etc/kvplane-tls/tls.crt", name
        assert env[prefix + "KEY_FILE"] == "/etc/kvplane-tls/tls.key", name
        assert _tls_secret(pod) == secret, name
        assert {"name": "grpc-tls", "mountPath": "/etc/kvplane-tls", "readOnly": True} in c["volumeMounts"]
        assert not any("TOKEN" in var for var in env), (name, sorted(env))


def test_tls_probes_run_kvplane_health_with_the_servers_certificate(checks: ModuleType) -> None:
    deployments = _render(checks, "mtls-values.yaml")
    for service in SERVICES:
        _, c = _pod(deployments[f"kvp-kvplane-{service}"])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert "grpc" not in probe  # Kubernetes' gRPC probe cannot speak TLS
            assert probe["exec"]["command"] == [
                "kvplane",
                "health",
                "localhost:50051",
                "--tls-ca-file=/etc/kvplane-tls/ca.crt",
                f"--tls-server-name=kvp-kvplane-{service}",
                "--tls-cert-file=/etc/kvplane-tls/tls.crt",
                "--tls-key-file=/etc/kvplane-tls/tls.key",
                "--timeout-s=4",
                # Liveness and startup ask the health service an etcd outage leaves SERVING.
                *(["--service=liveness"] if kind != "readinessProbe" else []),
            ]
            assert probe["timeoutSeconds"] > 4


def test_tls_without_client_certificates_keeps_tokens_and_checks_one_server_name(checks: ModuleType) -> None:
    deployments = _render(checks, "tls-token-values.yaml")
    _, c = _pod(deployments["kvp-kvplane-routing"])
    env = _env(c)
    assert env["KVPLANE_AUTH__MODE"] == "token"
    assert "KVPLANE_GRPC__TLS__CLIENT_CA_FILE" not in env
    assert "--tls-cert-file=/etc/kvplane-tls/tls.crt" not in c["livenessProbe"]["exec"]["command"]
    assert "--tls-server-name=kvplane.example.internal" in c["livenessProbe"]["exec"]["command"]
    _, gateway = _pod(deployments["kvp-kvplane-gateway"])
    env = _env(gateway)
    assert env["KVPLANE_GATEWAY__ROUTING_TLS_SERVER_NAME"] == "kvplane.example.internal"
    assert "KVPLANE_GATEWAY__ROUTING_TLS_CERT_FILE" not in env
    assert env["KVPLANE_GATEWAY__ROUTING_TOKEN_FILE"] == "/etc/kvplane-auth/token"


def test_without_tls_probes_stay_grpc_and_no_certificate_is_mounted(checks: ModuleType) -> None:
    docs = checks.render_chart({"engines": {"sim": {"enabled": True}}}, "kvp", "kvplane")
    for d in docs:
        if not is_kvplane_workload(d):
            continue
        pod, c = _pod(d)
        assert _tls_secret(pod) is None
        assert not any("TLS" in var and "ETCD" not in var for var in _env(c))
        if d["metadata"]["name"].removeprefix("kvp-kvplane-") in SERVICES:
            assert c["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
            assert c["readinessProbe"]["grpc"] == {"port": 50051}


def test_without_tls_the_clients_may_send_their_tokens_in_clear_and_only_then(checks: ModuleType) -> None:
    import helm_python

    values = {"engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}}}
    clients = {"gateway", *(f"{kind}-{role}" for kind in ("sim", "vllm") for role in ("prefill", "decode"))}
    told = set()
    for d in checks.render_chart(values, "kvp", "kvplane"):
        if is_kvplane_workload(d) and _env(_pod(d)[1]).get("KVPLANE_CLIENT_ALLOW_PLAINTEXT") == "true":
            told.add(d["metadata"]["name"].removeprefix("kvp-kvplane-"))
    assert told == clients
    # With TLS, nothing is allowed in clear.
    for d in _render(checks, "mtls-values.yaml").values():
        assert "KVPLANE_CLIENT_ALLOW_PLAINTEXT" not in _env(_pod(d)[1])
    # Without TLS and without leave, the clients would refuse: the chart says so instead.
    with pytest.raises(helm_python.HelmError, match="allowPlaintextCredentials"):
        checks.render_chart({**values, "grpc": {"allowPlaintextCredentials": False}}, "kvp", "kvplane")


def test_tokens_are_files_each_pod_mounting_only_its_own_key(checks: ModuleType) -> None:
    values = {"engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}}}
    docs = checks.render_chart(values, "kvp", "kvplane")
    keys: dict[str, list[str]] = {}
    for d in docs:
        if not is_kvplane_workload(d):
            continue
        pod, c = _pod(d)
        name = d["metadata"]["name"].removeprefix("kvp-kvplane-")
        volumes = [v for v in pod["volumes"] if v["name"] == "auth"]
        keys[name] = [i["key"] for v in volumes for i in v["secret"]["items"]]
        # No token in the environment: a Secret volume follows a rotated Secret, a variable does not.
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c["env"] if "TOKEN" in e["name"])
        token_files = [e["value"] for e in c["env"] if e["name"].endswith(("TOKEN_FILE", "TOKENS_FILE"))]
        assert len(token_files) == 1, name
        mount = next(m for m in c["volumeMounts"] if m["name"] == "auth")
        assert token_files[0].startswith(mount["mountPath"] + "/"), name
    assert keys == {
        **{s: ["tokens.json"] for s in SERVICES},
        "gateway": ["gateway"],
        **{
            f"{kind}-{role}": [f"{kind}-{role}"] for kind in ("sim", "vllm") for role in ("prefill", "decode")
        },
    }


def test_the_chart_refuses_mtls_without_client_certificates_and_tls_without_secrets(
    checks: ModuleType,
) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match=r"grpc\.tls\.enabled and grpc\.tls\.mutual"):
        checks.render_chart({"auth": {"mode": "mtls"}}, "kvp", "kvplane")
    with pytest.raises(helm_python.HelmError, match="serverSecret"):
        checks.render_chart({"grpc": {"tls": {"enabled": True}}}, "kvp", "kvplane")
    with pytest.raises(helm_python.HelmError, match=r"clientSecrets\.gateway"):
        checks.render_chart({"grpc": {"tls": {"enabled": True, "serverSecret": "s"}}}, "kvp", "kvplane")
    sim_without = {
        "grpc": {"tls": {"enabled": True, "serverSecret": "s", "clientSecrets": {"gateway": "g"}}},
        "engines": {"sim": {"enabled": True}},
    }
    with pytest.raises(helm_python.HelmError, match=r"clientSecrets\.sim-prefill"):
        checks.render_chart(sim_without, "kvp", "kvplane")


def test_the_gateways_api_keys_are_a_file_from_their_secret(checks: ModuleType) -> None:
    values = {"gateway": {"apiKeysSecret": {"name": "keys", "key": "api-keys.json"}}}
    docs = checks.render_chart(values, "kvp", "kvplane")
    pod, c = _pod(next(d for d in docs if d["metadata"]["name"] == "kvp-kvplane-gateway"))
    assert _env(c)["KVPLANE_GATEWAY__API_KEYS_FILE"] == "/etc/kvplane-api-keys/api-keys.json"
    assert "KVPLANE_GATEWAY__API_KEYS" not in _env(c)
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {
        "secretName": "keys",
        "items": [{"key": "api-keys.json", "path": "api-keys.json"}],
    }
    assert {"name": "api-keys", "mountPath": "/etc/kvplane-api-keys", "readOnly": True} in c["volumeMounts"]


def test_a_certificate_variable_pointing_outside_every_mount_is_caught(checks: ModuleType) -> None:
    values = yaml.safe_load((CHART_CI / "mtls-values.yaml").read_text())
    docs = checks.render_chart(values, "kvp", "kvplane")
    routing = next(
        d for d in docs if is_kvplane_workload(d) and d["metadata"]["name"] == "kvp-kvplane-routing"
    )
    container = routing["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "grpc-tls"]
    report = checks.Report()
    checks.check_chart_semantics("[test]", docs, checks.merged_values(values), report)
    assert (
        "[test] StatefulSet kvp-kvplane-routing: KVPLANE_GRPC__TLS__CERT_FILE (/etc/kvplane-tls/tls.crt) "
        "is in a mounted volume" in report.failures
    )


def test_a_plaintext_etcd_needs_allow_insecure(checks: ModuleType) -> None:
    import helm_python

    def told(docs: dict[str, dict[str, Any]]) -> dict[str, bool]:
        """Each process that reaches etcd: whether it is told a plaintext, unauthenticated one will do."""
        envs = {name: _env(_pod(d)[1]) for name, d in docs.items()}
        return {
            name: env.get("KVPLANE_ETCD__ALLOW_INSECURE") == "true"
            for name, env in envs.items()
            if "KVPLANE_ETCD__ENDPOINTS" in env
        }

    # By default etcd serves TLS and asks for client certificates: nobody is told.
    secure = {
        d["metadata"]["name"]: d for d in checks.render_chart({}, "kvp", "kvplane") if is_kvplane_workload(d)
    }
    assert told(secure) and not any(told(secure).values())
    assert not any(told(_render(checks, "etcd-tls-values.yaml")).values())
    # A plaintext etcd (development) must be asked for twice: TLS off, and leave to use it.
    plaintext: dict[str, Any] = {"etcd": {"tls": {"enabled": False}, "setup": {"enabled": False}}}
    plain = {
        d["metadata"]["name"]: d
        for d in checks.render_chart({"etcd": {**plaintext["etcd"], "allowInsecure": True}}, "kvp", "kvplane")
        if is_kvplane_workload(d)
    }
    assert told(plain) and all(told(plain).values())
    # Without TLS and without leave, every process would refuse at start: the chart says so instead.
    with pytest.raises(helm_python.HelmError, match="allowInsecure"):
        checks.render_chart(plaintext, "kvp", "kvplane")
