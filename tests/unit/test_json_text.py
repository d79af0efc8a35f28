"""Compact JSON text: the standard library's text, also for integers orjson refuses."""

from __future__ import annotations

import json

import pytest

from kvplane.services.common.model.json_text import dumps_compact


@pytest.mark.parametrize(
    "value",
    [
        {"remote_block_ids": [[1, 2, 3]], "remote_engine_id": "e", "do_remote_prefill": True},
        {"b": 1, "a": {"z": None, "y": [1.5, "é", "\u2028"]}},
        {"remote_kv_source": {"kv_request_id": "r"}, "big": 2**64 - 1, "negative": -(2**63)},
        [],
    ],
)
def test_the_text_is_the_standard_librarys_compact_text(value: object) -> None:
    assert json.loads(dumps_compact(value)) == value
    assert dumps_compact(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_an_integer_beyond_64_bits_is_written_whole() -> None:
    value = {"id": 2**70, "ids": [-(2**65), 1]}
    assert json.loads(dumps_compact(value)) == value
