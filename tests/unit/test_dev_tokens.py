"""`kvplane dev-tokens`: fresh tokens, each principal's alone in its folder, the services' tokens
file and the gateways' API keys and cache-salt key, loadable as the settings read them; every
file 0600; nothing written over unless asked."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from kvplane.services.common.runtime.auth import CallCredentials, PrincipalKind
from kvplane.services.dev.token_set import (
    API_KEYS_FILE,
    CACHE_SALT_KEY_FILE,
    CONTROL_PLANE,
    GATEWAYS,
    TOKEN_FILE,
    TOKENS_FILE,
    new_token,
    token_set_files,
)
from kvplane.services.dev.tokens_cli import main
from kvplane.services.gateway.turn_request import configured_api_keys
from kvplane.services.settings import KvplaneSettings

ARGS = ["--node", "sim-prefill", "--node", "sim-decode", "--operator", "gateway", "--tenant", "tenant-a"]


def _write(out: Path, *extra: str) -> int:
    return main(["--out", str(out), *ARGS, *extra])


def test_each_principal_gets_its_own_token_and_the_services_a_file_of_all(tmp_path: Path) -> None:
    assert _write(tmp_path) == 0
    tokens = {
        name: (tmp_path / name / TOKEN_FILE).read_text() for name in ("sim-prefill", "sim-decode", "gateway")
    }
    assert len(set(tokens.values())) == 3 and all(len(t) >= 40 for t in tokens.values())
    auth = KvplaneSettings.load(
        None, {"auth": {"mode": "token", "tokens_file": str(tmp_path / CONTROL_PLANE / TOKENS_FILE)}}
    ).auth.authenticator()
    for name, token in tokens.items():
        principal = auth.authenticate(CallCredentials({"authorization": f"Bearer {token}"}))
        assert principal.name == name
        assert principal.kind is (PrincipalKind.OPERATOR if name == "gateway" else PrincipalKind.NODE)


def test_the_gateways_get_api_keys_and_a_salt_key(tmp_path: Path) -> None:
    assert _write(tmp_path) == 0
    keys_file = tmp_path / GATEWAYS / API_KEYS_FILE
    [entry] = json.loads(keys_file.read_text())
    gateway = KvplaneSettings.load(
        None,
        {
            "gateway": {
                "api_keys_file": str(keys_file),
                "cache_salt_key_file": str(tmp_path / GATEWAYS / CACHE_SALT_KEY_FILE),
            }
        },
    ).gateway
    assert configured_api_keys(gateway).tenant({"Authorization": f"Bearer {entry['token']}"}) == "tenant-a"
    assert len(gateway.salt_key()) >= 40


def test_every_file_is_0600_and_every_folder_0700(tmp_path: Path) -> None:
    assert _write(tmp_path / "tokens") == 0
    for path in (tmp_path / "tokens").rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def test_two_runs_give_different_tokens_and_keep_them_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _write(tmp_path / "a") == 0 and _write(tmp_path / "b") == 0
    first = (tmp_path / "a" / "gateway" / TOKEN_FILE).read_text()
    assert first != (tmp_path / "b" / "gateway" / TOKEN_FILE).read_text()
    assert _write(tmp_path / "a") == 1
    assert "--force" in capsys.readouterr().err
    assert _write(tmp_path / "a", "--if-missing") == 0
    assert (tmp_path / "a" / "gateway" / TOKEN_FILE).read_text() == first
    assert _write(tmp_path / "a", "--force") == 0
    assert (tmp_path / "a" / "gateway" / TOKEN_FILE).read_text() != first


@pytest.mark.parametrize(
    ("nodes", "operators", "tenants", "message"),
    [
        (["d0", "d0"], [], [], "named twice"),
        (["d0"], ["d0"], [], "named twice"),
        (["../d0"], [], [], "a name is"),
        ([], ["control-plane"], [], "shared folder"),
        ([], [], ["tenant-a"], "at least one"),
    ],
)
def test_names_that_would_collide_or_escape_are_refused(
    nodes: list[str], operators: list[str], tenants: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        token_set_files(nodes, operators, tenants)


def test_tokens_are_hex_so_none_reads_as_a_command_line_option() -> None:
    # base64url tokens start with "-" one time in 64: `--api-key -x...` is then a missing value.
    tokens = {new_token() for _ in range(500)}
    assert len(tokens) == 500
    assert all(re.fullmatch(r"[0-9a-f]{64}", token) for token in tokens)
