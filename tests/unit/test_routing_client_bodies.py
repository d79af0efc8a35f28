"""The gateway helper: the two vLLM request bodies of a routed turn."""

from __future__ import annotations

import json

import pytest

from kvplane.services.client import MissingPrefillParams, RouteResult, decode_body, leg_url, prefill_body
from kvplane.services.common.model.handles import KEY_CONVERSATION, KEY_RETAIN, KEY_TENANT
from kvplane.v1 import routing_pb2

P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "e-d0",
    "remote_block_ids": [[1, 2, 3]],
    "remote_blocks_expiry_time": 12.5,
    KEY_TENANT: "acme",
    KEY_CONVERSATION: "c1",
}


def route() -> RouteResult:
    return RouteResult.from_pb(
        routing_pb2.RouteResponse(
            route_id="r1",
            decision=routing_pb2.DECISION_PULL,
            prefill=routing_pb2.Endpoint(node_id="p0", http_url="http://[::1]:8000"),
            decode=routing_pb2.Endpoint(node_id="d0", http_url="http://127.0.0.1:8001"),
            prefill_kv_transfer_params_json=json.dumps(P_PARAMS),
            expected_reused_tokens=48,
        )
    )


def test_route_result_parses_the_response() -> None:
    r = route()
    assert (
        r.pulls and r.decision == "pull" and r.prefill_params == P_PARAMS and r.expected_reused_tokens == 48
    )


@pytest.mark.parametrize(
    "client",
    [
        {
            "model": "m",
            "prompt": [1, 2],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 500,
        },
        {
            "model": "m",
            "messages": [],
            "max_completion_tokens": 500,
            "kv_transfer_params": {"remote_engine_id": "evil"},
        },
        {"model": "m", "prompt": "x"},
    ],
)
def test_prefill_body_is_non_streaming_one_token_with_the_route_params(client: dict[str, object]) -> None:
    body = prefill_body(client, route())
    assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body
    if "max_completion_tokens" in client:
        assert body["max_completion_tokens"] == 1
    assert body["kv_transfer_params"] == P_PARAMS
    assert body["model"] == "m"
    assert client.get("max_tokens") != 1  # the caller's dict is not modified


def test_decode_body_carries_p_params_and_our_keys_and_drops_the_clients() -> None:
    client = {
        "model": "m",
        "stream": True,
        "max_tokens": 500,
        "kv_transfer_params": {"remote_engine_id": "evil"},
    }
    returned = {"do_remote_prefill": True, "remote_engine_id": "e-p0", "remote_block_ids": [[7]]}
    body = decode_body(client, route(), {"id": "x", "kv_transfer_params": returned})
    assert body["kv_transfer_params"] == {**returned, KEY_TENANT: "acme", KEY_CONVERSATION: "c1"}
    assert body["stream"] is True and body["max_tokens"] == 500


def test_decode_body_tells_d_not_to_keep_the_turns_kv_when_routing_says_so() -> None:
    returned = {"do_remote_prefill": True, "remote_engine_id": "e-p0", "remote_block_ids": [[7]]}
    kept = decode_body({"model": "m"}, route(), {"kv_transfer_params": returned})
    assert KEY_RETAIN not in kept["kv_transfer_params"]
    response = routing_pb2.RouteResponse()
    response.CopyFrom(route().response)
    response.skip_decode_retention = True
    skipped = decode_body({"model": "m"}, RouteResult.from_pb(response), {"kv_transfer_params": returned})
    assert skipped["kv_transfer_params"][KEY_RETAIN] is False


def test_decode_body_needs_p_params() -> None:
    with pytest.raises(MissingPrefillParams):
        decode_body({"model": "m"}, route(), {"choices": []})


def test_leg_url_joins_paths() -> None:
    assert leg_url("http://[::1]:8000") == "http://[::1]:8000/v1/completions"
    assert leg_url("http://h:1/", "v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_leg_bodies_share_no_mutable_part_with_the_request_or_each_other() -> None:
    client = {
        "model": "m",
        "prompt": [5, 6, 7],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "logit_bias": {"5": 1.5},
        "stop": ("a", ["b"]),
    }
    snapshot = json.loads(json.dumps(client))
    r = route()
    p_body = prefill_body(client, r)
    d_body = decode_body(client, r, {"kv_transfer_params": {"remote_block_ids": [[9, 8]], "x": {"y": 1}}})
    assert p_body["prompt"] == d_body["prompt"] == [5, 6, 7] and p_body["messages"] == client["messages"]

    for body in (p_body, d_body):
        body["prompt"].append(0)
        body["messages"][0]["content"][0]["text"] = "changed"
        body["logit_bias"]["6"] = 2.0
        body["stop"][1].append("c")
        body["kv_transfer_params"]["remote_block_ids"][0].append(0)
    assert json.loads(json.dumps(client)) == snapshot
    assert r.prefill_params == P_PARAMS
    assert p_body["prompt"] == d_body["prompt"] == [5, 6, 7, 0]
