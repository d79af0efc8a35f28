"""vLLM's handle keys are carried losslessly through the domain type and protobuf."""

from __future__ import annotations

import json

import pytest

from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import HandleFormatError, VllmHandle

D_HANDLE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "a6f3c0de-0000_dp1",
    "remote_request_id": "cmpl-7d1f-0",
    "remote_block_ids": [[3, 9, 27, 81], [4, 10, 28, 82]],
    "remote_num_tokens": 61,
    "remote_host": "fd00::7",
    "remote_port": 5601,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_blocks_expiry_time": 183654.12345678912,
    "remote_registration_generation": 3,
    "transfer_mode": "pull",
    "future_key": {"nested": [1, 2.5, None]},
}


def test_every_vllm_key_survives_protobuf_unchanged() -> None:
    handle = VllmHandle.from_kv_transfer_params(D_HANDLE)
    back = convert.vllm_from_pb(convert.vllm_to_pb(handle)).to_kv_transfer_params()
    expected = {k: v for k, v in D_HANDLE.items() if not k.startswith("do_remote")}
    assert back == expected
    # Floats survive bit for bit, including through JSON.
    assert json.loads(json.dumps(back))["remote_blocks_expiry_time"] == D_HANDLE["remote_blocks_expiry_time"]


def test_null_expiry_stays_null() -> None:
    handle = VllmHandle.from_kv_transfer_params({**D_HANDLE, "remote_blocks_expiry_time": None})
    assert convert.vllm_from_pb(convert.vllm_to_pb(handle)).remote_blocks_expiry_time is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_block_ids", [1, 2]),
        ("remote_block_ids", [["1"]]),
        ("remote_num_tokens", "61"),
        ("remote_port", True),
        ("remote_blocks_expiry_time", float("nan")),
        ("remote_engine_id", None),
    ],
)
def test_malformed_handles_are_rejected(key: str, value: object) -> None:
    with pytest.raises(HandleFormatError, match=key):
        VllmHandle.from_kv_transfer_params({**D_HANDLE, key: value})


def test_missing_key_is_named() -> None:
    params = dict(D_HANDLE)
    del params["remote_request_id"]
    with pytest.raises(HandleFormatError, match="remote_request_id"):
        VllmHandle.from_kv_transfer_params(params)
