"""Builders for routing policy unit tests: plain values, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvplane.connector.digests import digest_tokens
from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
from kvplane.services.routing.policy import Leg, LegContext, NodeState, Prompt, RouteSnapshot

NOW = 1_700_000_000_000
MODEL = "m"
FP = Fingerprint(MODEL, "bfloat16", "NHD")


def mk_node(node_id: str = "n", role: NodeRole = NodeRole.DECODE, **kw: Any) -> Node:
    values: dict[str, Any] = dict(
        node_id=node_id,
        incarnation=f"{node_id}-inc",
        role=role,
        engine_id=f"e-{node_id}",
        http_url=f"http://127.0.0.1:{8000 + len(node_id)}",
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        fingerprint=FP,
        block_size=16,
        kv_bytes_per_token=4096,
    )
    values.update(kw)
    return Node(**values)


def mk_load(node: Node, **kw: Any) -> NodeLoad:
    values: dict[str, Any] = dict(node_id=node.node_id, incarnation=node.incarnation, reported_unix_ms=NOW)
    values.update(kw)
    return NodeLoad(**values)


def state(node: Node, **load: Any) -> NodeState:
    return NodeState(node, mk_load(node, **load) if load else None)


def history(n: int, seed: int = 1) -> list[int]:
    return [(seed * 13 + i * 7) % 30_000 + 1 for i in range(n)]


def mk_handle(
    holder: Node, retained: Sequence[int], *, life_ms: int = 120_000, digests: bool = True
) -> CacheHandle:
    blocks = -(-len(retained) // holder.block_size)
    vllm = VllmHandle(
        remote_engine_id=holder.engine_id,
        remote_request_id="r1",
        remote_block_ids=(tuple(range(blocks)),),
        remote_num_tokens=len(retained),
        remote_host=holder.side_channel_host,
        remote_port=holder.side_channel_port,
        remote_blocks_expiry_time=123.0,
    )
    return CacheHandle(
        handle_id="h1",
        tenant="t",
        conversation="c",
        holder_node_id=holder.node_id,
        holder_incarnation=holder.incarnation,
        vllm=vllm,
        wall_expiry_unix_ms=NOW + life_ms,
        digests=digest_tokens(retained, holder.block_size) if digests else None,
        model=MODEL,
    )


def snap(
    nodes: Sequence[NodeState] = (),
    *,
    prompt: Prompt | None = None,
    handle: CacheHandle | None = None,
    **kw: Any,
) -> RouteSnapshot:
    return RouteSnapshot(
        model=kw.pop("model", MODEL),
        conversation=kw.pop("conversation", "c"),
        prompt=prompt or Prompt(100),
        nodes=tuple(nodes),
        now_unix_ms=kw.pop("now_unix_ms", NOW),
        handle=handle,
        **kw,
    )


def ctx(
    leg: Leg = Leg.DECODE,
    *,
    holder: Node | None = None,
    fingerprint: Fingerprint | None = None,
    snapshot: RouteSnapshot | None = None,
) -> LegContext:
    return LegContext(snapshot or snap(), leg, holder, fingerprint)


__all__ = [
    "FP",
    "MODEL",
    "NOW",
    "ctx",
    "history",
    "mk_handle",
    "mk_load",
    "mk_node",
    "replace",
    "snap",
    "state",
]
