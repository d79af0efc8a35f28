"""Compose runs etcd with TLS and client certificates, and commits no credential: what the
validator (deploy_checks.compose_credentials) holds it to, and that it catches each way back."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.deploy_validators import load_deploy_checks
from tests.unit.test_deploy_manifests import MISSING

pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"deploy validators not installed ({', '.join(MISSING)})"
)

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def resolved() -> dict[str, Any]:
    import compose

    out = subprocess.run(
        [
            str(Path(compose.__file__).parent / "docker-compose"),
            "-f",
            str(COMPOSE / "compose.yaml"),
            "config",
            "--format",
            "json",
        ],
        env={**os.environ, "COMPOSE_PROFILES": "*"},
        capture_output=True,
        text=True,
        check=True,
    )
    project: dict[str, Any] = json.loads(out.stdout)
    return project


def _failures(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path, change: Callable[[dict[str, Any]], None]
) -> list[str]:
    bad = copy.deepcopy(resolved)
    change(bad["services"])
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(bad))
    report = checks.Report()
    checks.check_compose(path, report)
    failures: list[str] = report.failures
    return failures


def test_the_committed_files_hold_no_credential() -> None:
    env = (COMPOSE / ".env").read_text()
    assert "TOKEN" not in env and "KEY" not in env, env
    config = yaml.safe_load((COMPOSE / "kvplane.yaml").read_text())
    assert "tokens" not in config["auth"] and "gateway" not in config


def test_etcd_serves_tls_only_and_asks_every_client_for_its_certificate(resolved: dict[str, Any]) -> None:
    command = resolved["services"]["etcd"]["command"]
    assert "--client-cert-auth" in command
    assert "--listen-client-urls=https://0.0.0.0:2379" in command
    assert not any(
        "ALLOW_INSECURE" in key
        for svc in resolved["services"].values()
        for key in svc.get("environment") or {}
    )


def test_the_stack_as_committed_passes(checks: ModuleType, resolved: dict[str, Any], tmp_path: Path) -> None:
    assert _failures(checks, resolved, tmp_path, lambda services: None) == []


def test_a_token_in_an_environment_variable_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        services["metadata"]["environment"]["KVPLANE_AUTH__TOKENS"] = (
            '[{"token": "dev-node-0123456789", "kind": "node", "name": "d0"}]'
        )

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose metadata: no credential in its environment"
    ]


def test_plaintext_etcd_is_caught(checks: ModuleType, resolved: dict[str, Any], tmp_path: Path) -> None:
    def change(services: dict[str, Any]) -> None:
        command = services["etcd"]["command"]
        services["etcd"]["command"] = [a for a in command if a != "--client-cert-auth"]

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose etcd: serves clients over TLS only and requires their certificates (--client-cert-auth)"
    ]


def test_reaching_etcd_insecurely_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        services["routing"]["environment"]["KVPLANE_ETCD__ALLOW_INSECURE"] = "true"

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose routing: does not reach etcd insecurely"
    ]


def test_a_service_given_another_services_etcd_certificate_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        for mount in services["routing"]["volumes"]:
            if mount["source"] == "etcd-routing":
                mount["source"] = "etcd-metadata"

    failures = _failures(checks, resolved, tmp_path, change)
    assert failures == [
        f"compose routing: KVPLANE_ETCD__TLS_{what}_FILE from the certificate of etcd user kvplane-routing"
        for what in ("CA", "CERT", "KEY")
    ]


def test_an_engine_given_another_engines_token_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        services["sim-decode"]["volumes"][0]["source"] = "token-sim-prefill"

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose sim-decode: KVPLANE_SIM_AUTH_TOKEN_FILE from node sim-decode's folder"
    ]


def test_a_container_mounting_a_token_it_does_not_read_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        services["gateway"]["volumes"].append(
            {"type": "volume", "source": "token-operator", "target": "/run/ops", "read_only": True}
        )

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose gateway: mounts no other principal's token"
    ]


def test_starting_before_a_one_shot_completes_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    def change(services: dict[str, Any]) -> None:
        services["metadata"]["depends_on"]["etcd-setup"]["condition"] = "service_started"

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose metadata: waits for etcd-setup to complete"
    ]


def test_a_one_shot_service_waiting_for_a_long_running_one_is_caught(
    checks: ModuleType, resolved: dict[str, Any], tmp_path: Path
) -> None:
    # podman starts etcd-setup again with each service that needs it, and with it what it needs:
    # podman 4.3 fails to when that is a running service (etcd).
    def change(services: dict[str, Any]) -> None:
        services["etcd-setup"]["depends_on"]["etcd"] = {"condition": "service_healthy", "required": True}

    assert _failures(checks, resolved, tmp_path, change) == [
        "compose etcd-setup: a one-shot service waits for one-shot services only (etcd)"
    ]
