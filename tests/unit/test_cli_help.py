"""`kvplane --help` says what every command is for, and `serve --help` gives its defaults."""

from __future__ import annotations

import pytest

from kvplane.services.cli import EXTRA_COMMANDS, SERVICES, main


def test_top_level_help_states_each_commands_purpose(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "see `kvplane" not in out
    for command in ["serve", *EXTRA_COMMANDS]:
        assert f"\n    {command}" in out, command
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in out and "KVPLANE_CONFIG" in out


def test_serve_help_gives_the_defaults_of_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for default in ("127.0.0.1:50051", "127.0.0.1:2379", "9464"):
        assert default in text
    for service in SERVICES:
        assert service in text


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvplane {metadata.version('kvplane')}"


def test_help_loads_no_serving_stack() -> None:
    # `kvplane --help` must answer at once: grpc, etcd and the settings model load only to serve.
    import subprocess
    import sys

    probe = (
        "import sys; from kvplane.services.cli import main\n"
        "try: main(['--help'])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('grpc', 'aetcd', 'kvplane.services.process', 'kvplane.services.settings') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
