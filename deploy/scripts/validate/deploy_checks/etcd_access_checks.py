"""Who reaches the chart's etcd, and as whom (templates/etcd-certificates.yaml, etcd-setup.yaml).

Each service mounts the client certificate of its own etcd user and nobody else's; the gateway,
the picker and the engines mount none and are given no etcd address; the chart's own
certificates name their users (CN) and etcd's members (SANs) and chain to the chart's CA; etcd
requires client certificates; the setup Job is a post-install and post-upgrade hook running
`kvplane etcd-setup` as root, its settings loading as the command will load them.
"""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

from .kvplane_code import load_settings
from .report import Report

SERVICES = ("metadata", "routing", "eviction")
TLS_MOUNT = "/etc/kvplane-etcd-tls"


def _user(client: str) -> str:
    from kvplane.services.etcd_access.principals import PROCESS_USERS, ROOT_USER

    return ROOT_USER if client == "root" else PROCESS_USERS[client]


def _secret_name(full: str, tls: dict[str, Any], client: str) -> str:
    own = tls["serverSecret"] if client == "server" else tls["clientSecrets"][client]
    return str(own or f"{full}-etcd-{client}")


def _etcd_secret(pod: dict[str, Any]) -> str | None:
    for volume in pod["spec"].get("volumes", []):
        if volume["name"] == "etcd-tls":
            return str(volume["secret"]["secretName"])
    return None


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}


def _certificate(secret: dict[str, Any]) -> Any:
    from cryptography import x509

    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))


def check_etcd_access(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    e, tls = values["etcd"], values["etcd"]["tls"]
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    full = next(n.removesuffix("-metadata") for n in workloads if n.endswith("-metadata"))
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for name, workload in workloads.items():
        pod = workload["spec"]["template"]
        env = _env(pod["spec"]["containers"][0])
        client = name.removeprefix(f"{full}-")
        if client in SERVICES:
            want = _secret_name(full, tls, client) if tls["enabled"] else None
            report.check(
                _etcd_secret(pod) == want
                and (env.get("KVPLANE_ETCD__TLS_CERT_FILE") == f"{TLS_MOUNT}/tls.crt")
                == bool(tls["enabled"]),
                f"{label} {name}: presents the etcd certificate of {_user(client)} alone iff etcd.tls is on",
                f"{_etcd_secret(pod)} != {want}",
            )
        elif client != "etcd":
            report.check(
                _etcd_secret(pod) is None and not any(k.startswith("KVPLANE_ETCD__") for k in env),
                f"{label} {name}: mounts no etcd certificate and is given no etcd address",
            )
    if tls["enabled"] and e["enabled"]:
        etcd = workloads[f"{full}-etcd"]["spec"]["template"]
        command = etcd["spec"]["containers"][0]["command"]
        report.check(
            ("--client-cert-auth" in command) == bool(tls["clientCertAuth"])
            and {v["name"]: v for v in etcd["spec"]["volumes"]}["tls"]["secret"]["secretName"]
            == _secret_name(full, tls, "server"),
            f"{label} etcd: serves its certificate, and requires clients' iff clientCertAuth",
        )
    _check_generated(label, full, e, secrets, report)
    _check_setup(label, full, docs, e, report)


def _check_generated(
    label: str, full: str, e: dict[str, Any], secrets: dict[str, Any], report: Report
) -> None:
    """The chart's own certificates: each client's CN is its user, the members' SANs name them."""
    tls = e["tls"]
    if not tls["enabled"]:
        return
    ca_secret = secrets.get(f"{full}-etcd-ca")
    for client in ("server", *SERVICES, "root"):
        name = _secret_name(full, tls, client)
        generated = name == f"{full}-etcd-{client}"
        if client == "server" and not e["enabled"]:
            continue
        if (
            not report.check(
                (name in secrets) == generated,
                f"{label} Secret {name}: the chart makes it iff the values name none of their own",
            )
            or not generated
        ):
            continue
        if not report.check(
            ca_secret is not None, f"{label} Secret {full}-etcd-ca: holds the chart's etcd CA"
        ):
            continue
        assert ca_secret is not None
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.x509.oid import NameOID

        ca = x509.load_pem_x509_certificate(base64.b64decode(ca_secret["data"]["ca.crt"]))
        cert = _certificate(secrets[name])
        try:
            cert.verify_directly_issued_by(ca)
            chained = True
        except (ValueError, TypeError, InvalidSignature):
            chained = False
        report.check(
            chained and secrets[name]["data"]["ca.crt"] == ca_secret["data"]["ca.crt"],
            f"{label} Secret {name}: signed by the chart's etcd CA, which it carries",
        )
        if client == "server":
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            dns = set(sans.get_values_for_type(x509.DNSName))
            members = {f"{full}-etcd-{i}.{full}-etcd" for i in range(int(e["replicas"]))}
            report.check(
                all(any(d.startswith(m + ".") for d in dns) for m in members)
                and ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress),
                f"{label} Secret {name}: names every member and loopback",
                str(sorted(dns)),
            )
        else:
            cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
            report.check(
                cn == _user(client), f"{label} Secret {name}: its CN is the etcd user {_user(client)}", cn
            )


def _check_setup(
    label: str, full: str, docs: list[dict[str, Any]], e: dict[str, Any], report: Report
) -> None:
    jobs = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == f"{full}-etcd-setup"]
    if not report.check(
        len(jobs) == int(bool(e["setup"]["enabled"])), f"{label}: etcd setup Job iff enabled"
    ):
        return
    for job in jobs:
        name = f"{label} Job {job['metadata']['name']}"
        hooks = set(job["metadata"].get("annotations", {}).get("helm.sh/hook", "").split(","))
        report.check(
            hooks == {"post-install", "post-upgrade"}, f"{name}: runs after every install and upgrade"
        )
        pod = job["spec"]["template"]
        container = pod["spec"]["containers"][0]
        report.check(container["args"][:1] == ["etcd-setup"], f"{name}: runs kvplane etcd-setup")
        report.check(
            _etcd_secret(pod) == _secret_name(full, e["tls"], "root"),
            f"{name}: presents root's etcd certificate",
        )
        configmap = next(
            d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{full}-settings"
        )
        env = _env(container)
        try:
            settings = load_settings(env, configmap["data"]["kvplane.yaml"], {})
            ok, detail = True, ""
        except Exception as exc:
            ok, detail, settings = False, repr(exc), None
        report.check(ok, f"{name}: its settings (ConfigMap + env) load", detail)
        if settings is not None:
            report.check(
                settings.etcd.tls_cert_file.startswith(TLS_MOUNT + "/")
                and any(m["mountPath"] == TLS_MOUNT for m in container["volumeMounts"]),
                f"{name}: its certificate is mounted where its settings read it",
            )
