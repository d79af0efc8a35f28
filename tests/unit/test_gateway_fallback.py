"""The gateway's choice of fallback engine, its suspect list, and the settings' URL lists."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplane.services.gateway.cli import build_parser, overrides
from kvplane.services.gateway.fallback import FallbackEngines, pick_engine
from kvplane.services.gateway.settings import GatewaySection, engine_url_list
from kvplane.services.gateway.suspects import SuspectEngines

P = ["http://p0:8000", "http://p1:8000", "http://p2:8000"]


def test_picks_rotate_over_every_engine() -> None:
    engines = FallbackEngines(P, ["http://d0:8000"], SuspectEngines(5))
    assert [engines.prefill(0.0).url for _ in range(4)] == [*P, P[0]]
    assert {engines.decode(0.0).url for _ in range(3)} == {"http://d0:8000"}


def test_suspect_engines_are_skipped_until_they_lapse() -> None:
    suspects = SuspectEngines(5)
    suspects.mark("http://p1:8000/", 10.0)  # spelt with a slash: the same engine
    assert pick_engine(P, 1, suspects.current(12.0)).url == P[2]
    assert pick_engine(P, 1, suspects.current(12.0)).reason == "skipped failed engines"
    assert pick_engine(P, 1, suspects.current(15.0)).url == P[1]  # lapsed: tried again
    assert not suspects.current(15.0)


def test_the_avoided_engine_is_never_chosen_while_another_is_configured() -> None:
    everyone = frozenset(u for u in P)
    assert pick_engine(P, 0, everyone, avoid={P[0]}).url == P[1]
    assert pick_engine(P, 0, everyone, avoid={P[0]}).reason == "every other engine suspect"
    # The only engine is tried even when it just failed: a turn must not fail on a guess.
    assert pick_engine(P[:1], 0, {P[0]}, avoid={P[0]}).url == P[0]


def test_every_engine_suspect_still_tries_one() -> None:
    assert pick_engine(P, 2, frozenset(P)).url == P[2]
    assert pick_engine(P, 2, frozenset(P)).reason == "every engine suspect"


def test_url_lists_from_a_string_a_json_list_or_a_list() -> None:
    assert engine_url_list("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    assert engine_url_list('["http://a:1"]') == ["http://a:1"]
    assert engine_url_list(["https://[::1]:8100/"]) == ["https://[::1]:8100/"]
    assert engine_url_list("") == []


@pytest.mark.parametrize(
    "bad",
    ["a:1", "http://a:1,", "ftp://a:1", "http://a:x", "http://a:1?q=2", "http://a:1,http://a:1/", "[1]"],
)
def test_a_malformed_url_is_an_error_naming_it(bad: str) -> None:
    with pytest.raises(ValueError):
        engine_url_list(bad)


def test_prefill_and_decode_fallbacks_go_together() -> None:
    with pytest.raises(ValidationError, match="go together"):
        GatewaySection(fallback_prefill_url=["http://p:1"])
    section = GatewaySection(fallback_prefill_url="http://p:1", fallback_decode_url="http://d:1")  # type: ignore[arg-type]
    assert section.fallback_prefill_url == ["http://p:1"] and section.fallback_decode_url == ["http://d:1"]


def test_cli_flags_repeat_and_split_on_commas() -> None:
    args = build_parser().parse_args(
        [
            "--fallback-prefill",
            "http://p0:1,http://p1:1",
            "--fallback-prefill",
            "http://p2:1",
            "--fallback-decode",
            "http://d0:1",
        ]
    )
    gateway = overrides(args)["gateway"]
    assert gateway["fallback_prefill_url"] == ["http://p0:1", "http://p1:1", "http://p2:1"]
    assert gateway["fallback_decode_url"] == ["http://d0:1"]
