"""The hostile-body benchmark's bodies are what it says: the largest reach the parser, the 16 MiB
one is refused by its count alone."""

from __future__ import annotations

import pytest

from kvplane.bench.hostile_body_bench import hostile_bodies
from kvplane.services.gateway.admission import ReadLimits, json_values_for_context, parse_json
from kvplane.services.gateway.openai_errors import RequestRejected

CONTEXT = 4096


def _limits() -> ReadLimits:
    return ReadLimits(16 << 20, 30.0, 32, json_values_for_context(CONTEXT))


def test_the_bodies_at_the_cap_are_parsed_and_hold_nearly_the_cap() -> None:
    bodies = hostile_bodies(CONTEXT)
    cap = json_values_for_context(CONTEXT)
    ids = parse_json(bodies["ids-at-cap"], _limits())["prompt"]
    assert cap - 8 <= len(ids) <= cap
    nested = parse_json(bodies["nested-at-cap"], _limits())["x"]
    assert cap // 2 - 16 <= len(nested) <= cap // 2


def test_the_16_mib_body_is_refused_by_its_count() -> None:
    body = hostile_bodies(CONTEXT)["ids-16MiB"]
    assert (16 << 20) - 64 <= len(body) <= 16 << 20
    with pytest.raises(RequestRejected) as refused:
        parse_json(body, _limits())
    assert refused.value.status == 413
