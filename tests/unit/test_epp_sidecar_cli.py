"""`kvplane epp` and `kvplane sidecar`: their flags, and their sections in kvplane's settings."""

from __future__ import annotations

import pytest

from kvplane.services.cli import main
from kvplane.services.epp import cli as epp_cli
from kvplane.services.settings import KvplaneSettings
from kvplane.services.sidecar import cli as sidecar_cli


@pytest.mark.parametrize("command", ["epp", "sidecar"])
def test_each_command_has_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert f"kvplane {command}" in capsys.readouterr().out


def test_the_pickers_flags_land_in_the_epp_and_gateway_sections() -> None:
    args = epp_cli.build_parser().parse_args(
        ["--listen", "0.0.0.0:9002", "--routing", "r1:1,r2:2", "--sidecar-port", "8001"]
    )
    settings = KvplaneSettings.load(None, epp_cli.overrides(args))
    assert (settings.epp.listen, settings.epp.sidecar_port) == ("0.0.0.0:9002", 8001)
    assert settings.gateway.routing == ["r1:1", "r2:2"]


def test_the_sidecars_flags_land_in_its_section() -> None:
    args = sidecar_cli.build_parser().parse_args(
        ["--listen", "0.0.0.0:8000", "--decode-url", "http://127.0.0.1:8200"]
    )
    settings = KvplaneSettings.load(None, sidecar_cli.overrides(args))
    assert (settings.sidecar.listen, settings.sidecar.decode_url) == ("0.0.0.0:8000", "http://127.0.0.1:8200")


def test_the_route_key_comes_from_the_environment_and_is_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLANE_SIDECAR__ROUTE_KEY", "secret-route-key")
    settings = KvplaneSettings.load(None)
    assert settings.sidecar.route_key.get_secret_value() == "secret-route-key"
    assert "secret-route-key" not in settings.masked_json()


def test_a_decode_url_that_is_not_an_engine_url_is_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        KvplaneSettings.load(None, {"sidecar": {"decode_url": "ftp://x"}})
