"""Freeing a prefill engine's held blocks at once when its turn's D leg failed or was refused.

After its leg, P keeps the turn's KV for D to read, until D's read or the end
of P's lease (30 s in vLLM). When D refuses the request (a `max_tokens` that
P, which generates one token, accepted), fails, or never receives it, nobody
reads those blocks, and a tenant sending such turns could fill a P with KV
nobody else can use. The caller's failed ReportTurn names what P returned;
routing checks that it names a request of that prefill node and queues a
release command for it in etcd, which the eviction coordinator delivers to
the node's agent like any release. On the node the command frees the request
as an early release frees a handle; a request already read or expired makes
it a no-op.

Checks, in order (a malformed field is INVALID_ARGUMENT; a hold that cannot
be matched to a live node is ignored, since a restarted P holds nothing):

1. the params are a JSON object of P's own handle (`do_remote_prefill`), with
   a request id and an engine id;
2. the named node is registered, serves prefill, and has that engine id;
   with no node named (a turn served by the gateway's fallback engines while
   routing was unreachable), the registered prefill node with that engine id.

Who may ask (reports.py): a tenant only for a route this replica made for it,
to that node; the gateway (an operator) for any of its turns.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.services.common.model import convert, validation
from kvplane.services.common.model.errors import InvalidArgument
from kvplane.services.common.model.handles import CacheHandle, PendingRelease, ReleaseReason, VllmHandle
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.store import NodeRecord, Store, fencing

FIELD = "prefill_kv_transfer_params_json"
MAX_PARAMS_BYTES = 64 << 10
# The command waits for the node at most this long: P's own lease frees the blocks by then.
COMMAND_TTL_S = 60


@dataclass(frozen=True, slots=True)
class PrefillHold:
    """Blocks a prefill engine holds for one request, waiting for D's read."""

    node_id: str
    incarnation: str
    engine_id: str
    request_id: str
    # The node's NIXL side channel, which the blocks are served from.
    host: str
    port: int


def prefill_hold(params_json: str, node_id: str, nodes: Mapping[str, NodeRecord]) -> PrefillHold | None:
    """The hold that `params_json` (P's returned kv_transfer_params) names on `node_id`, or None."""
    validation.text(params_json, FIELD, max_bytes=MAX_PARAMS_BYTES)
    validation.ident(node_id, "prefill_node_id", required=False)
    try:
        params: Any = json.loads(params_json)
    except (ValueError, RecursionError):
        raise InvalidArgument(FIELD, "is not valid JSON") from None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise InvalidArgument(FIELD, "must be the kv_transfer_params a prefill engine returned")
    request_id, engine_id = params.get("remote_request_id"), params.get("remote_engine_id")
    if not isinstance(request_id, str) or not isinstance(engine_id, str):
        raise InvalidArgument(FIELD, "must name remote_request_id and remote_engine_id")
    validation.ident(request_id, f"{FIELD}.remote_request_id")
    validation.ident(engine_id, f"{FIELD}.remote_engine_id")
    if not node_id:
        node_id = next((r.node.node_id for r in nodes.values() if r.node.engine_id == engine_id), "")
    record = nodes.get(node_id)
    if record is None:
        return None
    node = record.node
    if node.role not in (NodeRole.PREFILL, NodeRole.BOTH) or node.engine_id != engine_id:
        return None
    return PrefillHold(
        node_id, node.incarnation, engine_id, request_id, node.side_channel_host, node.side_channel_port
    )


async def release_prefill(store: Store, hold: PrefillHold, tenant: str, conversation: str) -> str:
    """Queues the release command for `hold`; returns its id."""
    command_id = uuid.uuid4().hex
    handle = CacheHandle(
        handle_id=f"prefill-{hold.request_id}",
        tenant=tenant,
        conversation=conversation,
        holder_node_id=hold.node_id,
        holder_incarnation=hold.incarnation,
        # The node releases by request id; the blocks themselves are the engine's to know.
        vllm=VllmHandle(hold.engine_id, hold.request_id, (), 0, hold.host, hold.port),
        wall_expiry_unix_ms=int((time.time() + COMMAND_TTL_S) * 1000),
    )
    pending = PendingRelease(command_id, handle, ReleaseReason.REQUESTED, int(time.time() * 1000))
    lease = await store.grant_lease(COMMAND_TTL_S)
    value = convert.pending_to_pb(pending).SerializeToString()
    # The command's key is new: a re-sent write puts the same value again.
    await store.etcd.write(
        "queue_prefill_release", [], [fencing.put(store.keys.release(hold.node_id, command_id), value, lease)]
    )
    return command_id
