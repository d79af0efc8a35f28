"""The gateway's settings section: keys from the environment, masked at start-up."""

from __future__ import annotations

import json

import pytest

from kvplane.services.settings import KvplaneSettings


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
