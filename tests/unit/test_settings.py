"""The settings object: precedence, strictness and masking."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from kvplane.services.settings import KvplaneSettings
from kvplane.services.settings_errors import SettingsError


def test_a_misspelt_key_in_a_section_is_one_line_with_the_closest_name() -> None:
    with pytest.raises(SettingsError) as err:
        KvplaneSettings.load(overrides={"gateway": {"modelz": ["x"]}})
    assert str(err.value) == "unknown setting gateway.modelz (did you mean gateway.models?)"


def test_a_misspelt_section_and_a_bad_value_are_named_with_their_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SettingsError, match=r"^unknown setting routng \(did you mean routing\?\)$"):
        KvplaneSettings.load(overrides={"routng": {}})
    monkeypatch.setenv("KVPLANE_ROUTING__CHECKOUT_TIMEOUT_S", "soon")
    with pytest.raises(SettingsError) as err:
        KvplaneSettings.load()
    message = str(err.value)
    assert "\n" not in message and message.startswith("routing.checkout_timeout_s: ")
    assert "'soon'" in message and "KVPLANE_ROUTING__CHECKOUT_TIMEOUT_S" in message


def test_an_unreadable_settings_file_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SettingsError, match="No such file"):
        KvplaneSettings.load(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("routing: [unclosed\n")
    with pytest.raises(SettingsError) as err:
        KvplaneSettings.load(str(broken))
    assert str(err.value).startswith(f"settings file {broken}: ") and "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_commands_print_the_settings_problem_in_one_line_and_exit_2(tmp_path, command: str) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "kvplane.yaml"
    config.write_text("routing:\n  checkout_timout_s: 1\n")
    argv = [sys.executable, "-m", "kvplane.services.cli", command, *(["all"] if command == "serve" else [])]
    done = subprocess.run([*argv, "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    hint = "(did you mean routing.checkout_timeout_s?)"
    assert done.stderr.strip() == f"kvplane {command}: unknown setting routing.checkout_timout_s {hint}"


def test_flags_override_environment_which_overrides_the_file(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "kvplane.yaml"
    config.write_text("grpc: {listen: '127.0.0.1:1'}\netcd: {endpoints: ['file:1'], prefix: /from-file/}\n")
    monkeypatch.setenv("KVPLANE_ETCD__ENDPOINTS", '["env:2"]')
    monkeypatch.setenv("KVPLANE_ETCD__ALLOW_INSECURE", "true")
    settings = KvplaneSettings.load(str(config), {"grpc": {"listen": "127.0.0.1:3"}})
    assert settings.grpc.listen == "127.0.0.1:3"
    assert settings.etcd.endpoints == ["env:2"]
    assert settings.etcd.prefix == "/from-file/"


def test_secrets_are_masked_in_the_start_up_dump() -> None:
    settings = KvplaneSettings.load(
        overrides={
            "auth": {
                "mode": "token",
                "tokens": [{"token": "s3cret-value-0123456789", "name": "a", "tenant": "a"}],
            }
        }
    )
    dumped = settings.masked_json()
    assert "s3cret-value-0123456789" not in dumped
    assert "**********" in dumped


def test_a_node_token_binds_its_node_id_or_the_ids_its_prefix_covers() -> None:
    from kvplane.services.common.model.errors import PermissionDenied
    from kvplane.services.common.runtime.auth import Principal, PrincipalKind

    exact = Principal(PrincipalKind.NODE, "d0")
    assert exact.as_node("d0", "node_id") == "d0"
    shared = Principal(PrincipalKind.NODE, "kvp-sim-prefill-*")
    assert shared.as_node("kvp-sim-prefill-7f9c-x2", "node_id") == "kvp-sim-prefill-7f9c-x2"
    for other, principal in (("d1", exact), ("kvp-sim-decode-1", shared), ("kvp-sim-prefill-", shared)):
        with pytest.raises(PermissionDenied):
            principal.as_node(other, "node_id")


def test_serve_settings_have_no_default_authentication_mode() -> None:
    settings = KvplaneSettings.model_validate({})
    assert settings.auth.mode is None
    with pytest.raises(ValueError, match=r"auth\.mode is required"):
        settings.auth.authenticator()


@pytest.mark.parametrize("endpoint", ["https://etcd.example:2379", "HTTPS://10.0.0.5:2379"])
def test_an_https_etcd_endpoint_without_trust_roots_is_refused_not_downgraded(endpoint: str) -> None:
    with pytest.raises(SettingsError, match=r"asks for TLS but etcd\.tls_ca_file is not set"):
        KvplaneSettings.load(overrides={"etcd": {"endpoints": [endpoint]}})
    tls = {
        "endpoints": [endpoint],
        "tls_ca_file": "/ca.pem",
        "tls_cert_file": "/c.pem",
        "tls_key_file": "/k.pem",
    }
    settings = KvplaneSettings.load(overrides={"etcd": tls})
    assert settings.etcd.endpoints == [endpoint]


def test_an_etcd_password_is_never_sent_in_clear_off_loopback() -> None:
    remote = {"endpoints": ["etcd-0.etcd:2379"], "user": "kvplane", "password": "s3cret-pass"}
    with pytest.raises(SettingsError, match=r"password would go in clear to etcd-0\.etcd:2379"):
        KvplaneSettings.load(overrides={"etcd": remote})
    # Over TLS, on loopback, or with the development switches, it is allowed.
    KvplaneSettings.load(overrides={"etcd": {**remote, "tls_ca_file": "/ca.pem"}})
    KvplaneSettings.load(overrides={"etcd": {**remote, "endpoints": ["127.0.0.1:2379", "[::1]:2379"]}})
    KvplaneSettings.load(
        overrides={"etcd": {**remote, "allow_plaintext_password": True, "allow_insecure": True}}
    )


@pytest.mark.parametrize(
    ("etcd", "missing"),
    [
        ({}, r"without TLS \(etcd\.tls_ca_file\) or credentials \(etcd\.tls_cert_file or etcd\.user\)"),
        ({"tls_ca_file": "/ca.pem"}, r"without credentials \(etcd\.tls_cert_file or etcd\.user\):"),
        ({"user": "kvplane", "password": "s3cret-pass", "allow_plaintext_password": True}, r"without TLS"),
    ],
)
def test_an_etcd_off_loopback_without_tls_or_credentials_is_refused_unless_allowed(
    etcd: dict[str, object], missing: str
) -> None:
    remote = {"endpoints": ["127.0.0.1:2379", "etcd-0.etcd:2379"], **etcd}
    with pytest.raises(SettingsError, match=rf"etcd member etcd-0\.etcd:2379 is not on loopback .*{missing}"):
        KvplaneSettings.load(overrides={"etcd": remote})
    KvplaneSettings.load(overrides={"etcd": {**remote, "allow_insecure": True}})
    # On loopback nothing is asked for; off it, TLS with a client certificate or an etcd user is enough.
    KvplaneSettings.load(overrides={"etcd": {**etcd, "endpoints": ["127.0.0.1:2379", "localhost:2379"]}})
    secure = {"tls_ca_file": "/ca.pem", "tls_cert_file": "/c.pem", "tls_key_file": "/k.pem"}
    KvplaneSettings.load(overrides={"etcd": {**remote, **secure}})
    KvplaneSettings.load(
        overrides={"etcd": {**remote, "tls_ca_file": "/ca.pem", "user": "u", "password": "p"}}
    )


def test_a_sections_own_refusal_repeats_none_of_its_values() -> None:
    remote = {"password": "s3cret-pass-0123456789", "endpoints": ["etcd-0.etcd:2379"], "user": "kvplane"}
    short_token = {"mode": "token", "tokens": [{"token": "shh-short", "name": "a"}]}
    for overrides, section in (({"etcd": remote}, "etcd"), ({"auth": short_token}, "auth.tokens.0")):
        with pytest.raises(SettingsError) as err:
            KvplaneSettings.load(overrides=overrides)
        message = str(err.value)
        assert message.startswith(f"{section}: ") and "Value error" not in message
        assert "s3cret" not in message and "shh-short" not in message and "{" not in message


def test_mesh_mode_is_refused_unless_acknowledged_as_experimental_and_then_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mesh = {"mode": "mesh", "mesh": {"secrets": ["s3cret-mesh-0123456789"]}}
    with pytest.raises(SettingsError) as err:
        KvplaneSettings.load(overrides={"auth": mesh})
    message = str(err.value)
    assert "\n" not in message and "s3cret" not in message
    assert "auth.mesh_experimental" in message
    assert "bind no identity the proxy verified" in message and "chooses any principal" in message
    settings = KvplaneSettings.load(overrides={"auth": {**mesh, "mesh_experimental": True}})
    with caplog.at_level(logging.WARNING, logger="kvplane.services.common.settings"):
        settings.auth.authenticator()
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "experimental" in warning.getMessage() and "any principal" in warning.getMessage()
    # The other modes need no acknowledgement.
    assert KvplaneSettings.load(overrides={"auth": {"mode": "token"}}).auth.mesh_experimental is False
