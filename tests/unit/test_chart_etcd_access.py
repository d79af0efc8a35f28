"""The chart's etcd, secure by default: TLS on its client and peer ports, client certificates
required, each service presenting its own (CN = its etcd user, from the chart's CA unless the
values name Secrets of their own), nobody else holding one, and a post-install/post-upgrade Job
running `kvplane etcd-setup` as root; the backups present root's certificate."""

from __future__ import annotations

import base64
import importlib.util
from types import ModuleType
from typing import Any

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from kvplane.services.etcd_access.principals import PROCESS_USERS, ROOT_USER
from tests.support.deploy_validators import is_kvplane_workload, load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="deploy validators not installed: pip install -e '.[dev]'",
)

SERVICES = ("metadata", "routing", "eviction")
OWN_SECRETS: dict[str, Any] = {
    "etcd": {
        "tls": {
            "serverSecret": "etcd-server",
            "clientSecrets": {
                "metadata": "m-tls",
                "routing": "r-tls",
                "eviction": "e-tls",
                "root": "root-tls",
            },
        }
    }
}


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def default(checks: ModuleType) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = checks.render_chart(
        {"engines": {"sim": {"enabled": True}}}, "kvp", "kvplane"
    )
    return docs


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _workload(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return next(
        d for d in docs if is_kvplane_workload(d) and d["metadata"]["name"] == f"kvp-kvplane-{component}"
    )


def _etcd_secret(pod: dict[str, Any]) -> str | None:
    return next((v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "etcd-tls"), None)


def _certificate(secret: dict[str, Any], key: str = "tls.crt") -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


def test_by_default_etcd_serves_tls_and_requires_client_certificates(default: list[dict[str, Any]]) -> None:
    etcd = _named(default, "StatefulSet", "kvp-kvplane-etcd")["spec"]["template"]["spec"]
    command = etcd["containers"][0]["command"]
    assert "--listen-client-urls=https://0.0.0.0:2379" in command
    assert "--listen-peer-urls=https://0.0.0.0:2380" in command
    assert all("=http://" not in a for a in command if a.startswith("--initial-cluster="))
    assert {"--client-cert-auth", "--peer-client-cert-auth", "--trusted-ca-file=/etc/etcd/tls/ca.crt"} <= set(
        command
    )
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in command  # the probes' port stays plain
    assert {"name": "tls", "secret": {"secretName": "kvp-kvplane-etcd-server"}} in etcd["volumes"]


def test_by_default_each_service_presents_its_own_certificate_naming_its_etcd_user(
    default: list[dict[str, Any]],
) -> None:
    ca = _certificate(_named(default, "Secret", "kvp-kvplane-etcd-ca"), "ca.crt")
    presented = set()
    for component in SERVICES:
        pod = _workload(default, component)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVPLANE_ETCD__TLS_CERT_FILE"] == "/etc/kvplane-etcd-tls/tls.crt"
        assert "KVPLANE_ETCD__ALLOW_INSECURE" not in env
        assert {"name": "etcd-tls", "mountPath": "/etc/kvplane-etcd-tls", "readOnly": True} in container[
            "volumeMounts"
        ]
        secret = _named(default, "Secret", str(_etcd_secret(pod)))
        cert = _certificate(secret)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == PROCESS_USERS[component]
        cert.verify_directly_issued_by(ca)
        assert secret["type"] == "kubernetes.io/tls" and _certificate(secret, "ca.crt") == ca
        presented.add(_etcd_secret(pod))
    assert len(presented) == len(SERVICES)


def test_nobody_else_holds_an_etcd_certificate_or_address(default: list[dict[str, Any]]) -> None:
    others = [
        d
        for d in default
        if is_kvplane_workload(d) and d["metadata"]["name"].split("-", 2)[2] not in SERVICES
    ]
    assert {d["metadata"]["name"] for d in others} >= {"kvp-kvplane-gateway", "kvp-kvplane-sim-prefill"}
    for workload in others:
        pod = workload["spec"]["template"]["spec"]
        assert _etcd_secret(pod) is None, workload["metadata"]["name"]
        names = {e["name"] for c in pod["containers"] for e in c.get("env", [])}
        assert not any(n.startswith("KVPLANE_ETCD__") for n in names), workload["metadata"]["name"]
    # The CA's key is in a Secret no pod mounts.
    mounted = {
        v.get("secret", {}).get("secretName")
        for d in default
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
    }
    assert "kvp-kvplane-etcd-ca" not in mounted


def test_the_members_certificate_names_every_member_and_the_headless_service(
    default: list[dict[str, Any]],
) -> None:
    cert = _certificate(_named(default, "Secret", "kvp-kvplane-etcd-server"))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(sans.get_values_for_type(x509.DNSName))
    members = {f"kvp-kvplane-etcd-{i}.kvp-kvplane-etcd.kvplane.svc" for i in range(3)}
    assert members | {"*.kvp-kvplane-etcd.kvplane.svc", "kvp-kvplane-etcd.kvplane.svc"} <= dns
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)


def test_the_setup_job_runs_etcd_setup_as_root_after_every_install_and_upgrade(
    default: list[dict[str, Any]],
) -> None:
    job = _named(default, "Job", "kvp-kvplane-etcd-setup")
    assert set(job["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {"post-install", "post-upgrade"}
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The etcd image has no Python: the Job runs kvplane's, as the services do.
    assert (
        container["image"]
        == _workload(default, "metadata")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    assert container["args"][0] == "etcd-setup"
    cert = _certificate(_named(default, "Secret", str(_etcd_secret(pod))))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ROOT_USER
    assert pod["serviceAccountName"] == "kvp-kvplane-etcd-setup"
    # etcd admits it on its client port: NetworkPolicies add up.
    policy = _named(default, "NetworkPolicy", "kvp-kvplane-etcd-setup")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "etcd"
    assert (
        policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        == "etcd-setup"
    )


def test_the_setup_job_is_admitted_to_etcd_in_the_mesh(checks: ModuleType) -> None:
    docs = checks.render_chart({"mesh": {"enabled": True}}, "kvp", "kvplane")
    policy = _named(docs, "AuthorizationPolicy", "kvp-kvplane-etcd-setup")
    assert policy["spec"]["rules"][0]["from"][0]["source"]["principals"] == [
        "cluster.local/ns/kvplane/sa/kvp-kvplane-etcd-setup"
    ]


def test_secrets_of_your_own_replace_the_charts(checks: ModuleType) -> None:
    docs = checks.render_chart(OWN_SECRETS, "kvp", "kvplane")
    assert not [d for d in docs if d["kind"] == "Secret" and "-etcd-" in d["metadata"]["name"]]
    own = OWN_SECRETS["etcd"]["tls"]["clientSecrets"]
    for component in SERVICES:
        assert _etcd_secret(_workload(docs, component)["spec"]["template"]["spec"]) == own[component]
    assert (
        _etcd_secret(_named(docs, "Job", "kvp-kvplane-etcd-setup")["spec"]["template"]["spec"]) == own["root"]
    )
    etcd = _named(docs, "StatefulSet", "kvp-kvplane-etcd")["spec"]["template"]["spec"]
    assert {"name": "tls", "secret": {"secretName": "etcd-server"}} in etcd["volumes"]


def test_an_external_etcd_over_tls_needs_each_client_certificate(checks: ModuleType) -> None:
    import helm_python

    external: dict[str, Any] = {"etcd": {"enabled": False, "external": {"endpoints": ["etcd.infra:2379"]}}}
    with pytest.raises(helm_python.HelmError, match=r"clientSecrets\.metadata"):
        checks.render_chart(external, "kvp", "kvplane")
    external["etcd"]["tls"] = {"clientSecrets": OWN_SECRETS["etcd"]["tls"]["clientSecrets"]}
    docs = checks.render_chart(external, "kvp", "kvplane")
    assert not any(d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-etcd") for d in docs)
    assert not [d for d in docs if d["kind"] == "Secret" and "-etcd-" in d["metadata"]["name"]]
    env = {
        e["name"]: e.get("value")
        for e in _workload(docs, "routing")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["KVPLANE_ETCD__ENDPOINTS"] == '["etcd.infra:2379"]'


def test_the_setup_needs_tls_and_client_certificate_auth(checks: ModuleType) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match=r"etcd\.setup needs etcd\.tls\.enabled"):
        checks.render_chart({"etcd": {"allowInsecure": True, "tls": {"enabled": False}}}, "kvp", "kvplane")
    with pytest.raises(helm_python.HelmError, match="clientCertAuth"):
        checks.render_chart({"etcd": {"tls": {"clientCertAuth": False}}}, "kvp", "kvplane")
    without = checks.render_chart({"etcd": {"setup": {"enabled": False}}}, "kvp", "kvplane")
    assert not [d for d in without if d["metadata"]["name"] == "kvp-kvplane-etcd-setup"]


def test_the_backups_present_roots_certificate(checks: ModuleType) -> None:
    docs = checks.render_chart({"etcd": {"backup": {"enabled": True}}}, "kvp", "kvplane")
    pod = _named(docs, "CronJob", "kvp-kvplane-etcd-backup")["spec"]["jobTemplate"]["spec"]["template"][
        "spec"
    ]
    secret = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "etcd-client-tls")
    cert = _certificate(_named(docs, "Secret", secret))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ROOT_USER
    etcdctl = pod["initContainers"][0]["command"]
    assert etcdctl[1].startswith("--endpoints=https://") and "--cert=/etc/etcd-client-tls/tls.crt" in etcdctl


def test_the_validator_catches_a_service_presenting_another_services_certificate(checks: ModuleType) -> None:
    import copy

    docs = copy.deepcopy(checks.render_chart({}, "kvp", "kvplane"))
    pod = _workload(docs, "routing")["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if volume["name"] == "etcd-tls":
            volume["secret"]["secretName"] = "kvp-kvplane-etcd-metadata"
    report = checks.Report()
    checks.check_etcd_access("[test]", docs, checks.merged_values({}), report)
    wanted = "presents the etcd certificate of kvplane-routing alone iff etcd.tls is on"
    assert report.failures == [f"[test] kvp-kvplane-routing: {wanted}"]
