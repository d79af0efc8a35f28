"""Builders of domain objects for tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from kvplane.connector.digests import digest_tokens
from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Node


def vllm_params(
    node: Node, request_id: str | None = None, num_tokens: int = 256, expiry: float | None = 1234.5
) -> dict[str, object]:
    blocks = max(1, num_tokens // node.block_size)
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": node.engine_id,
        "remote_request_id": request_id or f"cmpl-{uuid.uuid4().hex}",
        "remote_block_ids": [list(range(100, 100 + blocks))],
        "remote_num_tokens": num_tokens,
        "remote_host": node.side_channel_host,
        "remote_port": node.side_channel_port,
        "tp_size": 1,
        "remote_blocks_expiry_time": expiry,
    }


def make_handle(
    node: Node,
    tenant: str = "acme",
    conversation: str = "conv-1",
    *,
    tokens: Sequence[int] | None = None,
    life_ms: int = 120_000,
    request_id: str | None = None,
    retained_bytes: int = 1 << 20,
) -> CacheHandle:
    tokens = list(tokens) if tokens is not None else list(range(1, 257))
    params = vllm_params(node, request_id, num_tokens=len(tokens))
    return CacheHandle(
        handle_id="",
        tenant=tenant,
        conversation=conversation,
        holder_node_id=node.node_id,
        holder_incarnation=node.incarnation,
        vllm=VllmHandle.from_kv_transfer_params(params),
        wall_expiry_unix_ms=int(time.time() * 1000) + life_ms,
        retained_bytes=retained_bytes,
        digests=digest_tokens(tokens, node.block_size),
        model=node.fingerprint.model,
    )
