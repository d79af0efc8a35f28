"""The settings object: precedence, strictness and masking."""

from __future__ import annotations

import pydantic
import pytest

from kvplane.services.settings import KvplaneSettings


def test_a_misspelt_key_in_a_section_is_an_error() -> None:
    with pytest.raises(pydantic.ValidationError, match="modelz"):
        KvplaneSettings.load(overrides={"gateway": {"modelz": ["x"]}})


def test_flags_override_environment_which_overrides_the_file(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "kvplane.yaml"
    config.write_text("grpc: {listen: '127.0.0.1:1'}\netcd: {endpoints: ['file:1'], prefix: /from-file/}\n")
    monkeypatch.setenv("KVPLANE_ETCD__ENDPOINTS", '["env:2"]')
    settings = KvplaneSettings.load(str(config), {"grpc": {"listen": "127.0.0.1:3"}})
    assert settings.grpc.listen == "127.0.0.1:3"
    assert settings.etcd.endpoints == ["env:2"]
    assert settings.etcd.prefix == "/from-file/"


def test_secrets_are_masked_in_the_start_up_dump() -> None:
    settings = KvplaneSettings.load(
        overrides={
            "auth": {"mode": "token", "tokens": [{"token": "s3cret-value", "name": "a", "tenant": "a"}]}
        }
    )
    dumped = settings.masked_json()
    assert "s3cret-value" not in dumped
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
