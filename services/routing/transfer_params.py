"""The prefill leg's kv_transfer_params: a handle's vLLM keys, clipped to a verified prefix, plus
kvplane's own keys, so that the engines' connectors can check and publish.

Pure: vLLM's wire keys (PROTOCOL.md) from domain values, no I/O.
"""

from __future__ import annotations

from typing import Any

from kvplane.connector import digests as token_digests
from kvplane.services.common.model.handles import (
    KEY_CONVERSATION,
    KEY_DIGESTS,
    KEY_REMOTE_KV_SOURCE,
    KEY_TENANT,
    CacheHandle,
    fresh_prefill_params,
)


def prefill_params(
    tenant: str,
    conversation: str,
    handle: CacheHandle | None,
    *,
    clip_to_tokens: int = 0,
    route_id: str = "",
) -> dict[str, Any]:
    """The P leg's kv_transfer_params: every vLLM key of the handle untouched (but for
    a prefix pull, clipped to the verified prefix), plus our keys so that the engines'
    connectors can check and publish.

    A handle a vLLM decode engine moved to its CPU offloading tier names no block of D's KV
    cache but where D's offloading P2P tier serves the copies (`remote_kv_source`): P's
    OffloadingConnector looks the prompt's own block hashes up there, under `route_id` as the
    transfer's id (vLLM's `kv_request_id`)."""
    if handle is None:
        params = fresh_prefill_params()
    else:
        params = handle.prefill_kv_transfer_params()
        source = params.get(KEY_REMOTE_KV_SOURCE)
        if isinstance(source, dict):
            params[KEY_REMOTE_KV_SOURCE] = {**source, "kv_request_id": route_id or handle.handle_id}
        if handle.digests is not None:
            params[KEY_DIGESTS] = token_digests.encode(handle.digests)
            if clip_to_tokens > 0:
                clip_pull(params, clip_to_tokens, handle.digests.block_size)
    params[KEY_TENANT] = tenant
    params[KEY_CONVERSATION] = conversation
    return params


def decode_only_params(tenant: str, conversation: str) -> dict[str, Any]:
    """The kv_transfer_params of a turn D prefills itself (PREFILL_ON_DECODE): no remote blocks
    either way, so D's vLLM computes what its prefix cache lacks and, with bidirectional
    transfer on, keeps the turn's blocks as a decode engine does; our keys let its connector
    publish them as the conversation's next handle."""
    return {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        KEY_TENANT: tenant,
        KEY_CONVERSATION: conversation,
    }


def clip_pull(params: dict[str, Any], tokens: int, block_size: int) -> None:
    """Clips a pull to its first `tokens` tokens: P's vLLM then reads only those blocks.

    vLLM pulls `min(remote_num_tokens, prompt) - local hit` tokens from the tail of
    `remote_block_ids`, so both are cut to the verified prefix, as the prefill
    connector's own check does (`kvplane.connector.prefix_check`).
    """
    blocks = -(-tokens // block_size)
    params["remote_block_ids"] = [list(group[:blocks]) for group in params["remote_block_ids"]]
    params["remote_num_tokens"] = tokens
