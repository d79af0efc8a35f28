"""What the operations commands print: rows from the services' replies, as a table or as JSON.

Pure: no I/O; the time a row's age is measured against is an argument.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.nodes import Node, NodeLoad

Row = Mapping[str, Any]


def _age_s(then_ms: int, now_ms: int) -> float | None:
    return None if then_ms <= 0 else round(max(0, now_ms - then_ms) / 1000, 1)


def node_row(node: Node, load: NodeLoad | None, now_ms: int) -> dict[str, Any]:
    """One node, its state and its latest load report."""
    used = None
    if load is not None and load.total_kv_blocks > 0:
        used = round(100 * (1 - load.free_kv_blocks / load.total_kv_blocks), 1)
    return {
        "node": node.node_id,
        "role": node.role.name.lower(),
        "model": node.fingerprint.model,
        "url": node.http_url,
        "state": "draining" if node.draining else "serving",
        "running": None if load is None else load.running_requests,
        "queued": None if load is None else load.queued_requests,
        "queued_prefill_tokens": None if load is None else load.queued_prefill_tokens,
        "kv_used_pct": used,
        "retained_bytes": None if load is None else load.retained_bytes,
        "load_age_s": None if load is None else _age_s(load.reported_unix_ms, now_ms),
        "incarnation": node.incarnation,
    }


def handle_row(handle: CacheHandle, now_ms: int) -> dict[str, Any]:
    """One retained handle: whose, where, how much, for how long yet."""
    return {
        "tenant": handle.tenant,
        "conversation": handle.conversation,
        "holder": handle.holder_node_id,
        "tokens": handle.vllm.remote_num_tokens,
        "retained_bytes": handle.retained_bytes,
        "age_s": _age_s(handle.published_unix_ms, now_ms),
        "expires_in_s": round((handle.wall_expiry_unix_ms - now_ms) / 1000, 1),
        "handle": handle.handle_id,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def table(rows: Sequence[Row], columns: Sequence[str] | None = None, empty: str = "(none)") -> str:
    """Rows as aligned text columns, headed by their names in upper case."""
    if not rows:
        return empty
    names = list(columns or rows[0].keys())
    cells = [[_cell(row.get(n)) for n in names] for row in rows]
    heads = [n.upper() for n in names]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip() for cell in cells]
    return "\n".join(lines)


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
