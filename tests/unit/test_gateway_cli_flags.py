"""`kvplane gateway`'s flags become settings; an API key given on the command line is checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.services.gateway.cli import build_parser, main, overrides
from kvplane.services.settings import KvplaneSettings
from kvplane.services.settings_errors import SettingsError


def test_api_keys_from_flags_reach_the_gateways_settings() -> None:
    args = build_parser().parse_args(
        ["--api-key", "acme=key-acme-0123456789", "--api-key", "globex=key-globex-0123456789"]
    )
    settings = KvplaneSettings.load(None, overrides(args))
    keys = {k.tenant: k.token.get_secret_value() for k in settings.gateway.api_keys}
    assert keys == {"acme": "key-acme-0123456789", "globex": "key-globex-0123456789"}


@pytest.mark.parametrize("value", ["no-separator-secret", "=key-only", "acme="])
def test_a_malformed_api_key_is_refused_without_echoing_it(value: str) -> None:
    args = build_parser().parse_args(["--api-key", value])
    with pytest.raises(SettingsError) as err:
        overrides(args)
    assert (
        "TENANT=KEY" in str(err.value) and "secret" not in str(err.value) and "key-only" not in str(err.value)
    )


def test_file_flags_and_defaults_are_described() -> None:
    args = build_parser().parse_args(
        ["--api-keys-file", "/run/keys.json", "--routing-token-file", "/run/token"]
    )
    gateway = overrides(args)["gateway"]
    assert gateway["api_keys_file"] == "/run/keys.json" and gateway["routing_token_file"] == "/run/token"
    text = " ".join(build_parser().format_help().split())
    assert "default 127.0.0.1:8080" in text and "default 127.0.0.1:50051" in text


def test_routing_in_process_flags_reach_the_settings() -> None:
    args = build_parser().parse_args(
        ["--routing-in-process", "--grpc-listen", "127.0.0.1:50061", "--etcd", "127.0.0.2:1,localhost:2"]
    )
    settings = KvplaneSettings.load(None, overrides(args))
    assert settings.gateway.routing_in_process is True
    assert settings.grpc.listen == "127.0.0.1:50061"
    assert settings.etcd.endpoints == ["127.0.0.2:1", "localhost:2"]
    # Without the flag the gateway asks routing replicas, as before.
    assert (
        KvplaneSettings.load(None, overrides(build_parser().parse_args([]))).gateway.routing_in_process
        is False
    )


def test_routing_in_process_without_auth_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Its process serves the engines' streams: closed by default, as `kvplane serve` is.
    assert main(["--routing-in-process", "--listen", "127.0.0.1:0"]) == 2
    assert "auth.mode is required" in capsys.readouterr().err


def test_a_tokenizer_directory_that_cannot_be_loaded_stops_the_gateway_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-tokenizer"
    config = tmp_path / "gateway.yaml"
    config.write_text(f"gateway:\n  tokenizers:\n    demo: {missing}\n")
    assert main(["--config", str(config), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert "kvplane gateway: gateway.tokenizers['demo']" in err and str(missing) in err
