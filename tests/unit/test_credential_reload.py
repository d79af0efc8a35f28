"""Servers' credential files are read again when they change: tokens and the gateway's API keys are
added, rotated and revoked without a restart, and a bad rotation keeps the previous credentials."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kvplane.services.common.model.errors import Unauthenticated
from kvplane.services.common.runtime.auth import CallCredentials, PrincipalKind, ReloadingAuthenticator
from kvplane.services.common.settings import AuthSection
from kvplane.services.gateway.identity import ReloadingApiKeys, Unauthorized


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _call(token: str) -> CallCredentials:
    return CallCredentials({"authorization": f"Bearer {token}"})


def _write(path: Path, text: str) -> None:
    # A later modification time whatever the file system's resolution, as a rotation would leave.
    path.write_text(text)
    stamp = path.stat().st_mtime + 5
    os.utime(path, (stamp, stamp))


def _copy(source: str, dest: Path) -> None:
    _write(dest, Path(source).read_text())


def _authenticator(section: AuthSection, clock: Clock) -> ReloadingAuthenticator:
    return ReloadingAuthenticator(section._token_authenticator, check_interval_s=1.0, clock=clock)


def test_a_rewritten_tokens_file_adds_and_revokes_tokens_at_the_next_check(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    _write(tokens, json.dumps([{"token": "old-token-0123456789", "kind": "node", "name": "d0"}]))
    clock = Clock()
    auth = _authenticator(AuthSection(mode="token", tokens_file=str(tokens)), clock)
    assert auth.authenticate(_call("old-token-0123456789")).name == "d0"

    _write(tokens, json.dumps([{"token": "new-token-0123456789", "kind": "operator", "name": "ops"}]))
    # Checked at most once a second: until then the old set serves.
    assert auth.authenticate(_call("old-token-0123456789")).name == "d0"
    clock.now += 1.0
    principal = auth.authenticate(_call("new-token-0123456789"))
    assert (principal.kind, principal.name) == (PrincipalKind.OPERATOR, "ops")
    with pytest.raises(Unauthenticated):
        auth.authenticate(_call("old-token-0123456789"))


def test_a_rotated_token_file_of_one_entry_is_read_again(tmp_path: Path) -> None:
    secret = tmp_path / "gateway-token"
    _write(secret, "first-secret-0123456789\n")
    clock = Clock()
    section = AuthSection(
        mode="token", tokens=[{"token_file": str(secret), "kind": "operator", "name": "gw"}]
    )
    auth = _authenticator(section, clock)
    assert auth.authenticate(_call("first-secret-0123456789")).name == "gw"
    _write(secret, "second-secret-0123456789\n")
    clock.now += 1.0
    assert auth.authenticate(_call("second-secret-0123456789")).name == "gw"
    with pytest.raises(Unauthenticated):
        auth.authenticate(_call("first-secret-0123456789"))


def test_a_half_written_tokens_file_keeps_the_previous_tokens_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens.json"
    _write(tokens, json.dumps([{"token": "kept-token-0123456789", "kind": "tenant", "name": "acme"}]))
    clock = Clock()
    auth = _authenticator(AuthSection(mode="token", tokens_file=str(tokens)), clock)
    _write(tokens, '[{"token": "half')
    clock.now += 1.0
    with caplog.at_level(logging.WARNING, logger="kvplane.services.common.runtime.auth"):
        assert auth.authenticate(_call("kept-token-0123456789")).tenant == "acme"
    assert "keeping the previous ones" in caplog.text
    assert "kept-token-0123456789" not in caplog.text
    # Once the file is whole again, it is used.
    _write(tokens, json.dumps([{"token": "whole-token-0123456789", "kind": "tenant", "name": "acme"}]))
    clock.now += 1.0
    assert auth.authenticate(_call("whole-token-0123456789")).tenant == "acme"


def test_an_unreadable_tokens_file_at_start_up_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"auth\.tokens_file"):
        AuthSection(mode="token", tokens_file=str(tmp_path / "missing.json")).authenticator()
    not_a_list = tmp_path / "tokens.yaml"
    _write(not_a_list, "token: x\n")
    with pytest.raises(ValueError, match="list of token entries"):
        AuthSection(mode="token", tokens_file=str(not_a_list)).authenticator()


def test_a_rotated_mesh_secret_file_is_read_again(tmp_path: Path) -> None:
    secret = tmp_path / "mesh-secret"
    _write(secret, "mesh-one")
    clock = Clock()
    section = AuthSection(mode="mesh", mesh_experimental=True, mesh={"secret_files": [str(secret)]})
    auth = ReloadingAuthenticator(section._mesh_authenticator, check_interval_s=1.0, clock=clock)
    headers = {"x-kvplane-role": "operator"}
    assert auth.authenticate(CallCredentials({**headers, "x-kvplane-mesh-secret": "mesh-one"})).name
    _write(secret, "mesh-two")
    clock.now += 1.0
    assert auth.authenticate(CallCredentials({**headers, "x-kvplane-mesh-secret": "mesh-two"})).name
    with pytest.raises(Unauthenticated):
        auth.authenticate(CallCredentials({**headers, "x-kvplane-mesh-secret": "mesh-one"}))


def test_the_gateways_key_file_adds_rotates_and_revokes_keys_at_the_next_check(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.json"
    _write(keys, json.dumps([{"token": "key-one", "tenant": "acme"}]))
    clock = Clock()
    api_keys = ReloadingApiKeys({"static-key": "globex"}, str(keys), clock=clock)
    assert api_keys.tenant({"Authorization": "Bearer key-one"}) == "acme"
    _write(keys, json.dumps([{"token": "key-two", "tenant": "acme"}]))
    clock.now += 1.0
    assert api_keys.tenant({"Authorization": "Bearer key-two"}) == "acme"
    with pytest.raises(Unauthorized):
        api_keys.tenant({"Authorization": "Bearer key-one"})
    # Keys from the settings stay whatever the file says.
    assert api_keys.tenant({"x-api-key": "static-key"}) == "globex"


def test_a_bad_key_file_keeps_the_previous_keys_and_fails_loudly_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "api-keys.yaml"
    _write(keys, "- {token: key-one, tenant: acme}\n")
    clock = Clock()
    api_keys = ReloadingApiKeys({}, str(keys), clock=clock)
    _write(keys, "- {token: key-two, tenant: " + "t" * 300 + "}\n")  # past the tenant's length limit
    clock.now += 1.0
    with caplog.at_level(logging.WARNING, logger="kvplane.services.gateway.identity"):
        assert api_keys.tenant({"Authorization": "Bearer key-one"}) == "acme"
    assert "keeping the previous keys" in caplog.text
    with pytest.raises(ValueError, match="entry 0"):
        ReloadingApiKeys({}, str(_written(tmp_path / "bad.json", '[{"token": 3}]')))


def _written(path: Path, text: str) -> Path:
    _write(path, text)
    return path


async def test_a_client_channel_is_made_again_once_its_certificate_changes_and_kept_if_unreadable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvplane.services.common.runtime.reloading_channel import ReloadingChannel
    from kvplane.services.common.runtime.tls import ClientTlsFiles
    from tests.support.certificates import TestCa

    ca = TestCa(tmp_path / "ca")
    first, second = ca.issue("first"), ca.issue("second")
    cert, key = tmp_path / "client.pem", tmp_path / "client-key.pem"
    _copy(first.cert_file, cert)
    _copy(first.key_file, key)
    clock = Clock()
    channel = ReloadingChannel("127.0.0.1:1", ClientTlsFiles(ca.ca_file, str(cert), str(key)), clock=clock)
    try:
        original = channel.current()
        _copy(second.cert_file, cert)
        _copy(second.key_file, key)
        # Checked at most once a second.
        assert channel.current() is original
        clock.now += 1.0
        renewed = channel.current()
        assert renewed is not original and channel.reloads == 1
        # A key that vanishes mid-rotation keeps the working channel, with a warning.
        key.unlink()
        clock.now += 1.0
        with caplog.at_level(logging.WARNING, logger="kvplane.services.common.runtime.reloading_channel"):
            assert channel.current() is renewed
        assert "keeping the current channel" in caplog.text and channel.reloads == 1
    finally:
        await channel.close()


def test_a_tokens_file_others_may_write_is_refused_and_one_they_may_read_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = tmp_path / "tokens.json"
    _write(tokens, json.dumps([{"token": "owner-only-0123456789", "kind": "operator", "name": "ops"}]))
    tokens.chmod(0o666)  # anyone could add an operator token here
    with pytest.raises(ValueError, match="writable by group or others"):
        AuthSection(mode="token", tokens_file=str(tokens)).authenticator()
    tokens.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvplane.services.common.runtime.secret_files"):
        AuthSection(mode="token", tokens_file=str(tokens)).authenticator()
    assert "readable by others" in caplog.text
    tokens.chmod(0o600)
    caplog.clear()
    AuthSection(mode="token", tokens_file=str(tokens)).authenticator()
    assert "readable by others" not in caplog.text


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (
            [
                {"token": "same-token-0123456789", "name": "a"},
                {"token": "same-token-0123456789", "name": "b"},
            ],
            "share one token",
        ),
        ([{"token": "short", "name": "a"}], "can be guessed"),
        ([{"token": "node-token-0123456789", "kind": "node", "name": "*"}], "prefix ending in"),
        ([{"token": "node-token-0123456789", "kind": "node", "name": "d*x"}], "prefix ending in"),
    ],
)
def test_duplicate_short_and_wildcard_tokens_are_refused_at_load(
    entries: list[dict[str, str]], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        AuthSection(mode="token", tokens=entries).authenticator()  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["emptied", "deleted"])
def test_a_tokens_file_emptied_or_deleted_revokes_its_tokens_loudly_and_inline_ones_stay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    tokens = tmp_path / "tokens.json"
    _write(tokens, json.dumps([{"token": "file-token-0123456789", "kind": "operator", "name": "ops"}]))
    tokens.chmod(0o600)
    clock = Clock()
    section = AuthSection(
        mode="token",
        tokens_file=str(tokens),
        tokens=[{"token": "inline-token-0123456789", "kind": "tenant", "name": "acme"}],  # type: ignore[list-item]
    )
    auth = _authenticator(section, clock)
    assert auth.authenticate(_call("file-token-0123456789")).name == "ops"
    if how == "emptied":
        _write(tokens, "")
    else:
        tokens.unlink()
    clock.now += 1.0
    with (
        caplog.at_level(logging.ERROR, logger="kvplane.services.common.settings"),
        pytest.raises(Unauthenticated),
    ):
        auth.authenticate(_call("file-token-0123456789"))
    assert "every token it listed is revoked" in caplog.text
    assert auth.authenticate(_call("inline-token-0123456789")).tenant == "acme"
