"""What clients present to the control plane, from configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.connector.simengine.settings import parse_settings
from kvplane.services.client.credentials import ClientCredentials


def test_a_token_file_is_read_trimmed_and_sent_as_a_bearer_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    creds = ClientCredentials(token_file=str(token))
    assert creds.call_metadata((("x-kvplane-role", "node"),)) == (
        ("authorization", "Bearer s3cret"),
        ("x-kvplane-role", "node"),
    )
    assert "s3cret" not in repr(creds) and "s3cret" not in creds.describe()


def test_nothing_configured_presents_nothing() -> None:
    assert ClientCredentials().call_metadata() == ()
    assert ClientCredentials().describe() == "no credentials"


@pytest.mark.parametrize(
    "values",
    [
        {"token": "a", "token_file": "/f"},
        {"tls_cert_file": "/c", "tls_key_file": "/k"},
        {"tls_ca_file": "/ca", "tls_cert_file": "/c"},
    ],
)
def test_contradictory_or_incomplete_settings_are_refused(values: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        ClientCredentials(**values)


def test_credentials_come_from_the_environment() -> None:
    creds = ClientCredentials.from_env({"KVPLANE_CLIENT_TOKEN": "t", "KVPLANE_CLIENT_TLS_CA_FILE": "/ca.pem"})
    assert (creds.token, creds.tls_ca_file, creds.tls) == ("t", "/ca.pem", True)


def test_the_sim_engine_takes_credentials_from_flags_and_environment_and_never_prints_them() -> None:
    settings = parse_settings(
        ["--auth-token-file", "/run/secrets/node", "--tls-ca-file", "/ca.pem"],
        env={"KVPLANE_SIM_MESH_SECRET": "proxy-secret"},
    )
    creds = settings.credentials()
    assert (creds.token_file, creds.tls_ca_file, creds.mesh_secret) == (
        "/run/secrets/node",
        "/ca.pem",
        "proxy-secret",
    )
    assert "proxy-secret" not in settings.describe()


def test_a_rotated_token_file_is_sent_from_the_next_call_on(tmp_path: Path) -> None:
    import os

    from kvplane.services.client.credentials import CallMetadata

    token = tmp_path / "token"
    token.write_text("first")
    metadata = CallMetadata(ClientCredentials(token_file=str(token)), (("x-kvplane-role", "node"),))
    assert metadata.current()[0] == ("authorization", "Bearer first")
    token.write_text("second")
    later = os.stat(token).st_mtime + 5
    os.utime(token, (later, later))
    assert metadata.current()[0] == ("authorization", "Bearer second")
    # A rotation caught half-way (an empty file) keeps the last good token.
    token.write_text("")
    os.utime(token, (later + 5, later + 5))
    assert metadata.current()[0] == ("authorization", "Bearer second")
