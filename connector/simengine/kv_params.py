"""Reading and writing vLLM's ``kv_transfer_params`` dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.connector.simengine.side_channel import normalize_host

# kvplane's own key: the holder's incarnation, so a reader can tell a
# restarted engine that kept its engine id. Unknown keys pass through vLLM.
INCARNATION_KEY = "remote_incarnation"


@dataclass(frozen=True)
class RemoteBlocks:
    """The remote side named in a request's kv_transfer_params."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    num_tokens: int | None
    # In the holder's perf_counter clock; None disables the expiry gate.
    expiry_time: float | None
    incarnation: str | None


def _int_list(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return None
    return tuple(v)


def parse_remote(kvp: Mapping[str, Any]) -> RemoteBlocks | None:
    """The remote blocks of a request, or None when the dict names none (or names them badly)."""
    engine_id, request_id = kvp.get("remote_engine_id"), kvp.get("remote_request_id")
    host, port, groups = kvp.get("remote_host"), kvp.get("remote_port"), kvp.get("remote_block_ids")
    if not (isinstance(engine_id, str) and isinstance(request_id, str) and isinstance(host, str)):
        return None
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    # One list per KV-cache group; the simulator has a single group.
    if not isinstance(groups, list) or not groups:
        return None
    blocks = _int_list(groups[0])
    if blocks is None:
        return None
    num_tokens = kvp.get("remote_num_tokens")
    expiry = kvp.get("remote_blocks_expiry_time")
    incarnation = kvp.get(INCARNATION_KEY)
    return RemoteBlocks(
        engine_id=engine_id,
        request_id=request_id,
        block_ids=blocks,
        host=normalize_host(host),
        port=port,
        num_tokens=num_tokens if isinstance(num_tokens, int) and not isinstance(num_tokens, bool) else None,
        expiry_time=float(expiry)
        if isinstance(expiry, int | float) and not isinstance(expiry, bool)
        else None,
        incarnation=incarnation if isinstance(incarnation, str) else None,
    )


def holder_params(
    *,
    as_decode_handle: bool,
    engine_id: str,
    incarnation: str,
    request_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    num_tokens: int,
    expiry_time: float | None,
) -> dict[str, Any]:
    """The dict a holder returns: P's params for D, or D's handle for the next turn's P."""
    out: dict[str, Any] = {
        "do_remote_prefill": not as_decode_handle,
        "do_remote_decode": as_decode_handle,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        # Unbracketed, as vLLM emits its configured host; readers accept both forms.
        "remote_host": normalize_host(host),
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_registration_generation": 0,
        "transfer_mode": "pull",
        INCARNATION_KEY: incarnation,
    }
    if as_decode_handle:
        out["remote_blocks_expiry_time"] = expiry_time
    return out
