"""The gateway's bound on what a body may cost to parse: its JSON values are counted before it is
parsed, against a cap set from the engines' context length."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.admission import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_VALUES,
    ReadLimits,
    json_values_for_context,
    parse_json,
    read_limits,
)
from kvplane.services.gateway.openai_errors import RequestRejected
from kvplane.services.gateway.settings import GatewaySection


def _limits(max_values: int) -> ReadLimits:
    return ReadLimits(max_body_bytes=64 << 20, body_timeout_s=5.0, max_depth=8, max_values=max_values)


def _ids(n: int) -> bytes:
    return b'{"prompt": [' + b",".join([b"7"] * n) + b"]}"


def test_a_body_of_more_token_ids_than_the_cap_is_refused_before_it_is_parsed() -> None:
    # 100,000 ids: the body's separators count 99,999 commas, a `[` and a `{`.
    with pytest.raises(RequestRejected) as refused:
        parse_json(_ids(100_000), _limits(100_000))
    assert refused.value.status == 413
    assert "about 100002 JSON values" in refused.value.message and "limit is 100000" in refused.value.message
    assert parse_json(_ids(100_000), _limits(100_002))["prompt"] == [7] * 100_000


def test_nested_empty_arrays_count_as_values_too() -> None:
    body = b'{"x": [' + b",".join([b"[]"] * 40_000) + b"]}"
    with pytest.raises(RequestRejected) as refused:
        parse_json(body, _limits(50_000))
    assert refused.value.status == 413


def test_a_small_body_is_parsed_without_counting() -> None:
    # Under 64 KiB a parse is cheap whatever the body holds: the cap is not applied.
    assert len(parse_json(_ids(1_000), _limits(10))["prompt"]) == 1_000


def test_the_cap_follows_the_context_length_unless_set() -> None:
    assert json_values_for_context(32_768) == 2 * 32_768 + 65_536
    assert json_values_for_context(0) == DEFAULT_MAX_VALUES == 2 * (1 << 20) + 65_536
    assert read_limits(GatewaySection(max_model_len=4096)).max_values == 2 * 4096 + 65_536
    assert read_limits(GatewaySection(max_model_len=4096, max_json_values=500)).max_values == 500
    assert read_limits(GatewaySection()).max_values == DEFAULT_MAX_VALUES


def test_a_legitimate_prompt_at_the_context_length_passes_the_default_cap() -> None:
    context = 32_768
    limits = read_limits(GatewaySection(max_model_len=context))
    # Token ids at the context length pass, and so does a chat whose text holds a comma per token
    # of the context (each counts as a value) beside such a prompt.
    assert len(parse_json(_ids(context), limits)["prompt"]) == context
    text = b"," * context
    ids = b",".join([b"7"] * context)
    chat = b'{"messages": [{"role": "user", "content": "' + text + b'"}], "prompt": [' + ids + b"]}"
    assert parse_json(chat, limits)["messages"][0]["role"] == "user"


def test_the_body_limit_follows_the_context_length_unless_set() -> None:
    assert read_limits(GatewaySection(max_model_len=32_768)).max_body_bytes == 32 * 32_768 + (1 << 20)
    assert read_limits(GatewaySection(max_model_len=32_768, max_body_bytes=5000)).max_body_bytes == 5000
    assert read_limits(GatewaySection()).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 16 << 20


def test_a_prompt_at_the_context_length_fits_the_default_body_limit() -> None:
    context = 32_768
    limits = read_limits(GatewaySection(max_model_len=context))
    # The widest token ids there are, and a text prompt of escaped characters, 4 a token.
    ids = b'{"model": "m", "prompt": [' + b",".join([b"4294967295"] * context) + b"]}"
    text = b'{"messages": [{"role": "user", "content": "' + b"\\u00e9" * (4 * context) + b'"}]}'
    assert len(ids) < limits.max_body_bytes and len(text) < limits.max_body_bytes


@pytest.mark.parametrize(
    ("number", "shown"),
    [
        (b"18446744073709551616", "18446744073709551616"),  # 2**64
        (b"-9223372036854775809", "-9223372036854775809"),  # below int64
        (b"1" + b"0" * 60, "1" + "0" * 36 + "..."),
    ],
)
def test_an_integer_beyond_64_bits_is_refused_not_forwarded_as_a_float(number: bytes, shown: str) -> None:
    body = b'{"prompt": [1, 2], "seed": ' + number + b"}"
    with pytest.raises(RequestRejected) as refused:
        parse_json(body, _limits(100))
    assert refused.value.status == 400
    assert f"the integer {shown}, beyond 64 bits" in refused.value.message


def test_an_integer_past_a_doubles_range_is_refused_as_before() -> None:
    # orjson refuses it itself (past a double's range, and past the interpreter's digit limit).
    with pytest.raises(RequestRejected) as refused:
        parse_json(b'{"seed": ' + b"9" * 5000 + b"}", _limits(100))
    assert refused.value.status == 400 and "not valid JSON" in refused.value.message


def test_long_digit_runs_that_are_no_such_integer_pass_unchanged() -> None:
    body = (
        b'{"prompt": "call 123456789012345678901234567890 now", "seed": 18446744073709551615, '
        b'"min": -9223372036854775808, "t": 12345678901234567890.5}'
    )
    value = parse_json(body, _limits(100))
    assert value["prompt"] == "call 123456789012345678901234567890 now"
    assert value["seed"] == (1 << 64) - 1 and value["min"] == -(1 << 63)
    assert value["t"] == 12345678901234567890.5
