"""`kvplane serve`: which services a process runs, and the event loop it runs them on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
import uvloop

from kvplane.services import cli
from tests.conftest import AUTH_ENV


@pytest.fixture
def loops(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Runs nothing: records which loop `serve` chose and for which coroutine."""
    chosen: list[tuple[str, str]] = []

    def runner(name: str) -> Any:
        def run(coro: Coroutine[Any, Any, Any]) -> None:
            chosen.append((name, coro.cr_code.co_name))
            coro.close()

        return run

    monkeypatch.setattr(uvloop, "run", runner("uvloop"))
    monkeypatch.setattr(asyncio, "run", runner("asyncio"))
    for key, value in AUTH_ENV.items():
        monkeypatch.setenv(key, value)
    return chosen


def test_serve_takes_services_joined_by_commas(loops: list[tuple[str, str]]) -> None:
    parse = cli.build_parser().parse_args
    assert parse(["serve", "metadata, eviction"]).service == ["metadata", "eviction"]
    assert parse(["serve", "routing"]).service == ["routing"]
    assert parse(["serve", "all"]).service == ["all"]
    assert cli.main(["serve", "metadata,eviction"]) == 0
    assert loops == [("uvloop", "_serve")]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("metadata,bogus", "unknown service 'bogus'"),
        ("routing,routing", "names a service twice"),
        ("all,routing", "unknown service 'all'"),
        ("", "unknown service ''"),
    ],
)
def test_serve_refuses_a_service_it_does_not_have(
    value: str, says: str, loops: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", value])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
    assert loops == []


def test_serve_runs_on_uvloop_unless_told_asyncio(
    loops: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["serve", "all"]) == 0
    monkeypatch.setenv("KVPLANE_GRPC__EVENT_LOOP", "asyncio")
    assert cli.main(["serve", "all"]) == 0
    assert loops == [("uvloop", "_serve"), ("asyncio", "_serve")]


def test_serve_refuses_mesh_mode_unless_it_is_acknowledged_as_experimental(
    loops: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVPLANE_AUTH__MESH_EXPERIMENTAL")
    assert cli.main(["serve", "metadata"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("kvplane serve: ") and said.count("\n") == 1
    assert "auth.mesh_experimental" in said and "bind no identity the proxy verified" in said
    assert loops == []
