"""The gateway's settings section: keys from the environment, masked at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.services.settings import KvplaneSettings
from kvplane.services.settings_errors import SettingsError


def test_api_keys_from_the_environment_are_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [{"token": "very-secret-token", "tenant": "acme"}]
    monkeypatch.setenv("KVPLANE_GATEWAY__API_KEYS", json.dumps(keys))
    monkeypatch.setenv("KVPLANE_GATEWAY__ROUTING_TOKEN", "operator-secret")
    settings = KvplaneSettings.load(None, {"gateway": {"listen": "[::1]:8080"}})
    gateway = settings.gateway
    assert gateway.listen == "[::1]:8080"
    assert [(k.token.get_secret_value(), k.tenant) for k in gateway.api_keys] == [
        ("very-secret-token", "acme")
    ]
    shown = settings.masked_json()
    assert "very-secret-token" not in shown and "operator-secret" not in shown


def test_defaults_refuse_anonymous_requests_and_have_no_fallback() -> None:
    gateway = KvplaneSettings.load(None, {}).gateway
    assert gateway.default_tenant == "" and not gateway.api_keys
    assert gateway.fallback_prefill_url == gateway.fallback_decode_url == []


def test_the_cache_salt_key_may_come_from_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "cache-salt-key"
    key_file.write_text("salt-key-from-a-file\n")
    key_file.chmod(0o600)
    gateway = KvplaneSettings.load(None, {"gateway": {"cache_salt_key_file": str(key_file)}}).gateway
    assert gateway.salt_key() == "salt-key-from-a-file"
    inline = KvplaneSettings.load(None, {"gateway": {"cache_salt_key": "inline"}}).gateway
    assert inline.salt_key() == "inline"


def test_the_cache_salt_key_inline_and_from_a_file_is_refused(tmp_path: Path) -> None:
    both = {"cache_salt_key": "inline", "cache_salt_key_file": str(tmp_path / "key")}
    with pytest.raises(SettingsError, match="not both"):
        KvplaneSettings.load(None, {"gateway": both})
