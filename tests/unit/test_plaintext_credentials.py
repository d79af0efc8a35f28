"""A token or mesh secret never goes in clear off this machine unless allowed: a client refuses a
plaintext channel to such a target instead of sending it silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.services.client.credentials import ClientCredentials, PlaintextCredentials
from kvplane.services.common.model.loopback import loopback_target


@pytest.mark.parametrize(
    ("target", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.3.4.5:50051", True),
        ("[::1]:50051", True),
        ("localhost:50051", True),
        ("dns:///localhost:50051", True),
        ("ipv4:127.0.0.1:50051", True),
        ("unix:/run/kvplane.sock", True),
        ("http://127.0.0.1:2379", True),
        ("kvplane-routing:50051", False),
        ("10.0.0.5:50051", False),
        ("[2001:db8::1]:50051", False),
        ("dns:///kvplane-routing.ns.svc:50051", False),
        ("https://etcd.example:2379", False),
        ("localhost.evil.example:50051", False),
    ],
)
def test_what_counts_as_this_machine(target: str, loopback: bool) -> None:
    assert loopback_target(target) is loopback


@pytest.mark.parametrize(
    "secret",
    [{"token": "t0ken"}, {"token_file": "/run/token"}, {"mesh_secret": "s"}, {"mesh_secret_file": "/m"}],
)
def test_a_secret_is_not_sent_in_clear_off_this_machine(secret: dict[str, str]) -> None:
    creds = ClientCredentials(**secret, allow_plaintext=False)
    with pytest.raises(PlaintextCredentials, match="kvplane-routing:50051"):
        creds.channel("kvplane-routing:50051")
    # On loopback it may: nothing leaves the machine.
    creds.check_plaintext("127.0.0.1:50051")


def test_allowed_explicitly_it_is_sent() -> None:
    ClientCredentials(token="t0ken", allow_plaintext=True).check_plaintext("kvplane-routing:50051")


def test_no_secret_and_tls_need_no_leave() -> None:
    ClientCredentials(allow_plaintext=False).check_plaintext("kvplane-routing:50051")
    ClientCredentials(token="t", tls_ca_file="/ca.pem", allow_plaintext=False).check_plaintext("10.0.0.5:1")


def test_the_leave_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, allowed in (("true", True), ("1", True), ("false", False), ("", False)):
        env = {"KVPLANE_CLIENT_TOKEN": "t", "KVPLANE_CLIENT_ALLOW_PLAINTEXT": value}
        assert ClientCredentials.from_env(env).allow_plaintext is allowed
        # Credentials built from settings (the gateway's, the engines') read the same variable.
        monkeypatch.setenv("KVPLANE_CLIENT_ALLOW_PLAINTEXT", value)
        assert ClientCredentials(token="t").allow_plaintext is allowed
    monkeypatch.delenv("KVPLANE_CLIENT_ALLOW_PLAINTEXT")
    assert ClientCredentials(token="t").allow_plaintext is False


def test_a_gateway_told_to_send_its_token_in_clear_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvplane.services.gateway.cli import main

    monkeypatch.delenv("KVPLANE_CLIENT_ALLOW_PLAINTEXT", raising=False)
    token = tmp_path / "token"
    token.write_text("gateway-token-0123456789")
    token.chmod(0o600)
    config = tmp_path / "kvplane.yaml"
    config.write_text(
        json.dumps(
            {"gateway": {"routing_token_file": str(token), "api_keys": [{"token": "k" * 20, "tenant": "t"}]}}
        )
    )
    argv = ["--config", str(config), "--listen", "127.0.0.1:0", "--routing", "10.9.9.9:50051", "--model", "m"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvplane gateway: the bearer token") and "10.9.9.9:50051" in err[-1]
