"""The one builder of D's retained handle (handles.py): what the vLLM connector and the sim-engine
publish after a turn (`EngineHandles.finished`), and routing's report fallback (`retained_handle`)."""

from __future__ import annotations

from typing import Any

from kvplane.connector import digests as token_digests
from kvplane.connector.digests import KEY_TAIL_DIGEST, tail_digest
from kvplane.connector.prefix_check import PullOutcome, check_pull
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_HANDLE_ID,
    KEY_TENANT,
    EngineHandles,
    VllmHandle,
    retained_handle,
    routed_to,
)

BLOCK = 16
BYTES_PER_BLOCK = 4096
HANDLES = EngineHandles(model="m", block_size=BLOCK, bytes_per_block=BYTES_PER_BLOCK, expiry_margin_s=1.0)
PROMPT_AND_OUTPUT = list(range(1000, 1000 + 70))  # 69 tokens with KV: 4 whole blocks and 5 more
ROUTED = {KEY_TENANT: "t", KEY_CONVERSATION: "c", KEY_HANDLE_ID: "h-router"}


def finish_params(**changes: Any) -> dict[str, Any]:
    """D's params at a finish that keeps its blocks, as vLLM's NixlConnector returns them."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "d-engine",
        "remote_request_id": "cmpl-1",
        "remote_block_ids": ([7, 8, 9, 10, 11],),  # a tuple of lists inside the engine
        "remote_num_tokens": 69,
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_blocks_expiry_time": 1000.0 + 480.0,  # D's perf_counter clock
    }
    params.update(changes)
    return params


def finished(params: dict[str, Any], request_params: dict[str, Any]) -> Any:
    return HANDLES.finished(
        params,
        request_params,
        PROMPT_AND_OUTPUT,
        new_id="h-new",
        now_unix_s=1_700_000_000.0,
        engine_clock_s=1000.0,
    )


def test_a_routed_finish_is_stamped_and_built_into_the_handle_to_publish() -> None:
    params = finish_params()
    out = finished(params, ROUTED)
    held = PROMPT_AND_OUTPUT[:69]
    # The params D returns carry the router's handle id, the digests and the tail digest.
    assert params[KEY_HANDLE_ID] == "h-router"
    assert token_digests.decode(params[KEY_DIGESTS]) == token_digests.digest_tokens(held, BLOCK)
    assert params[KEY_TAIL_DIGEST] == tail_digest(held, BLOCK)
    handle = out.handle
    assert handle is not None and out.problem == ""
    assert (out.handle_id, handle.handle_id) == ("h-router", "h-router")
    assert (handle.tenant, handle.conversation, handle.model) == ("t", "c", "m")
    # The node agent stamps its node and incarnation.
    assert (handle.holder_node_id, handle.holder_incarnation) == ("", "")
    assert handle.vllm.remote_block_ids == ((7, 8, 9, 10, 11),)
    # The tail digest travels with the handle to the next turn's P.
    assert handle.vllm.extra == {KEY_TAIL_DIGEST: params[KEY_TAIL_DIGEST]}
    assert out.retained_bytes == handle.retained_bytes == 5 * BYTES_PER_BLOCK
    assert handle.digests == token_digests.digest_tokens(held, BLOCK)
    # 480 s of D's life left, less the 1 s margin, from the wall clock's now.
    assert handle.published_unix_ms == 1_700_000_000_000
    assert handle.wall_expiry_unix_ms == 1_700_000_000_000 + 479_000


def test_the_stamped_params_verify_on_the_prefill_side_for_a_continuation() -> None:
    params = finish_params()
    finished(params, ROUTED)
    next_prompt = [*PROMPT_AND_OUTPUT[:69], 5, 6, 7]
    check = check_pull(dict(params, do_remote_prefill=False), next_prompt)
    assert check.outcome is PullOutcome.VERIFIED and check.verified_tokens == 69


def test_a_request_kvplane_did_not_route_is_stamped_but_not_published() -> None:
    params = finish_params()
    out = finished(params, {KEY_TENANT: "t"})
    assert out.handle is None and out.problem == ""
    assert out.handle_id == params[KEY_HANDLE_ID] == "h-new"
    assert out.retained_bytes == 5 * BYTES_PER_BLOCK
    assert routed_to({KEY_TENANT: "t", KEY_CONVERSATION: ""}) is None
    assert routed_to(ROUTED) == ("t", "c")


def test_params_that_are_no_handle_say_why_and_publish_nothing() -> None:
    out = finished(finish_params(remote_port="5600"), ROUTED)
    assert out.handle is None
    assert "remote_port" in out.problem


def test_a_handle_without_an_engine_deadline_expires_at_the_margin() -> None:
    out = finished(finish_params(remote_blocks_expiry_time=None), ROUTED)
    assert out.handle is not None
    assert out.handle.wall_expiry_unix_ms == 1_700_000_000_000 - 1_000


def test_the_report_fallback_builds_the_same_handle_with_its_holder_and_the_engines_ttl() -> None:
    wire = dict(finish_params(), remote_block_ids=[[7, 8, 9, 10, 11]])
    vllm = VllmHandle.from_kv_transfer_params(wire)
    handle = retained_handle(
        vllm,
        tenant="t",
        conversation="c",
        handle_id="h-report",
        now_unix_ms=5_000,
        life_s=480.0,
        expiry_margin_s=1.0,
        bytes_per_block=BYTES_PER_BLOCK,
        model="m",
        digests=None,
        holder_node_id="d0",
        holder_incarnation="inc-1",
    )
    assert (handle.holder_node_id, handle.holder_incarnation) == ("d0", "inc-1")
    assert (handle.published_unix_ms, handle.wall_expiry_unix_ms) == (5_000, 5_000 + 479_000)
    assert handle.retained_bytes == 5 * BYTES_PER_BLOCK
