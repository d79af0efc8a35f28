"""A body's nesting depth is bounded after it parses: by walking its values when it holds few arrays
and objects, from its bytes when it holds many (so that a body of tens of thousands of empty arrays
costs no Python step per array), with the same answer either way."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.admission import ReadLimits, parse_json
from kvplane.services.gateway.openai_errors import RequestRejected

LIMITS = ReadLimits(max_body_bytes=64 << 20, body_timeout_s=5.0, max_depth=8, max_values=1 << 20)
# Past the walk's threshold (4,096 arrays and objects), and under it.
MANY, FEW = 6_000, 10


def _nested(depth: int, inner: bytes = b"1", *, pad: int) -> bytes:
    """An object (level 1) whose "a" nests arrays down to `depth` levels around `inner`, and `pad`
    empty arrays beside it in "x"."""
    opened = b"[" * (depth - 1)
    closed = b"]" * (depth - 1)
    filler = b",".join([b"[]"] * pad)
    return b'{"a": ' + opened + inner + closed + b', "x": [' + filler + b"]}"


@pytest.mark.parametrize("pad", [FEW, MANY])
def test_nesting_to_the_limit_passes_and_one_level_more_is_refused(pad: int) -> None:
    assert parse_json(_nested(8, pad=pad), LIMITS)["a"] is not None
    with pytest.raises(RequestRejected) as refused:
        parse_json(_nested(9, pad=pad), LIMITS)
    assert refused.value.status == 400 and "nests deeper than 8 levels" in refused.value.message


@pytest.mark.parametrize("pad", [FEW, MANY])
def test_brackets_inside_strings_are_not_nesting(pad: int) -> None:
    text = b'"' + b"[" * 50 + b"{" * 50 + b"]" * 7 + b'\\" [[[ \\\\"'
    body = _nested(3, text, pad=pad)
    assert parse_json(body, LIMITS)["a"] == [[text[1:-1].decode().replace('\\"', '"').replace("\\\\", "\\")]]


@pytest.mark.parametrize("pad", [FEW, MANY])
def test_unbalanced_brackets_in_strings_do_not_hide_nesting(pad: int) -> None:
    # Each level opens with a string holding "]" and closes after one holding "[": with the
    # strings' brackets read as brackets, the body would look one level deep ("[][][]...").
    inner = b"1"
    for _ in range(11):
        inner = b'["]", ' + inner + b', "["]'
    body = b'{"a": ' + inner + b', "x": [' + b",".join([b"[]"] * pad) + b"]}"
    with pytest.raises(RequestRejected) as refused:
        parse_json(body, LIMITS)
    assert "nests deeper than 8 levels" in refused.value.message


@pytest.mark.parametrize("pad", [FEW, MANY])
def test_a_string_ending_in_an_escaped_backslash_closes_where_json_says(pad: int) -> None:
    # "x\\" is the string x\ then its closing quote: read as an escaped quote instead, the string
    # would run on over the nesting after it and hide it.
    body = b'{"s": "x\\\\", "t": "\\\\\\"[", "a": ' + b"[" * 9 + b"1" + b"]" * 9 + b', "x": ['
    body += b",".join([b"[]"] * pad) + b"]}"
    with pytest.raises(RequestRejected) as refused:
        parse_json(body, LIMITS)
    assert "nests deeper than 8 levels" in refused.value.message
