"""The example-proxy baseline's request rewriting: what P is asked, and what D is sent after it."""

from __future__ import annotations

from typing import Any

from kvplane.bench.example_proxy import decode_body, engine_headers, prefill_body


def _request() -> dict[str, Any]:
    return {
        "model": "sim-model",
        "prompt": [11, 12, 13],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 8,
        "ignore_eos": True,
    }


def test_prefill_body_asks_for_one_unstreamed_token_and_keeps_the_kv_for_a_remote_decode() -> None:
    body = _request()
    p_body = prefill_body(body)
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_body["stream"] is False and p_body["max_tokens"] == 1
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["prompt"] == [11, 12, 13] and p_body["ignore_eos"] is True
    assert body == _request(), "the client's body is not changed"


def test_prefill_body_caps_max_completion_tokens_only_when_given() -> None:
    assert "max_completion_tokens" not in prefill_body(_request())
    assert prefill_body({**_request(), "max_completion_tokens": 50})["max_completion_tokens"] == 1


def test_prefill_params_are_a_fresh_copy_for_each_request() -> None:
    first = prefill_body(_request())
    first["kv_transfer_params"]["remote_host"] = "10.0.0.1"
    assert prefill_body(_request())["kv_transfer_params"]["remote_host"] is None


def test_decode_body_is_the_request_as_sent_with_the_params_p_answered() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    d_body = decode_body(_request(), {"choices": [], "kv_transfer_params": params})
    assert d_body == {**_request(), "kv_transfer_params": params}


def test_decode_body_without_params_from_p_leaves_the_request_unchanged() -> None:
    assert decode_body(_request(), {"choices": []}) == _request()
    assert decode_body(_request(), {"kv_transfer_params": None}) == _request()


def test_both_legs_carry_the_request_id_and_a_bearer_key() -> None:
    headers = engine_headers("r-1")
    assert headers["X-Request-Id"] == "r-1"
    assert headers["Authorization"].startswith("Bearer ")
